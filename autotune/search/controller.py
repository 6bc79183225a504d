"""The search over one workload, as ordered steps over one `Ledger` (search/ledger.py), from the first anchor
trial to the plan: which trial runs next, which measured configuration wins, and how the pick is refined. Each
step is a function in its own module that takes the ledger and returns it, having made one decision:

1. `climb.py`: which anchor rungs are measured, each explored in order (`explore.py`: two points, a prediction
   from the memory line, a verification, bisection or growth only after a miss), skipped where the time model
   of the best so far says it cannot win (time per micro-step ~ a + b x m; a higher rung lets the micro-batch
   grow, but costs at least its recompute/copy overhead per sample), and an offloading rung not run or not
   grown where its base with nothing offloaded bounds it (`offload_bound.py`).
2. With a lattice: `compile_beside.py` (whether compile pays, beside the fastest eager configuration without
   recompute), the climb over the recompute anchors, `blocks.py` (how many blocks to recompute between them),
   and `compiled_recompute.py` (compile with blocks recomputed); each places what the measured lines
   (`lines.py`, `placement.py`) predict can win and verifies it with trials (`measure.py`).
3. `choice.choose`: the pick, the fastest whole global step, within noise the one with more headroom; or
   `NoFeasiblePlan`.
4. `recheck.py`, `runoff.py`: a win more work cannot explain, and close leaders, measured again longer.
5. `choice.close`: the account of the pick, and what the search left untried.
6. Given an `AfterPick` (`fit`'s search): `offload_share.py` (the host share of an offloaded optimizer),
   `partitioned_state.py` (the optimizer state partitioned over replicated ranks), `offload_overlap.py`
   (whether the host optimizer overlaps the last backward), `reduce_timing.py` (when the all-reduce runs).

The plan's reason is composed once from the ledger they leave (`plan_reason.reason`).

The controller takes the trial runner as an argument, so tests drive it with scripted fakes. `sizes` restricts
the micro-batches tried (zero-change trials of `autotune run` need divisors of the per-rank batch, since the
script does its own batching): every size asked for is snapped down to an allowed one, and growth moves to the
next allowed size when snapping would stand still.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..configuration import Rung
from ..evidence import Trial
from .blocks import place_blocks
from .choice import choose, close, untried
from .climb import climb_all, climb_with_recompute, climb_without_recompute
from .compile_beside import place_compile
from .compiled_recompute import place_compiled_recompute
from .deadline import OutOfTime
from .ledger import AfterPick, Lattice, Ledger, Runner
from .lines import NOISE, snap
from .offload_overlap import overlap
from .offload_share import offload_share
from .partitioned_state import partitioned
from .placement import ruled_out
from .recheck import recheck_recompute
from .reduce_timing import reduce
from .runoff import runoff

__all__ = ["AFTER_PICK", "ANCHORS", "CONFIRM", "FIT_ADVICE", "LATTICE", "NOISE", "AfterPick", "Controller", "Lattice",
           "Step", "ruled_out", "run_steps"]


# What to change when nothing fits, in `fit`'s words; `autotune run` gives its own options' (`advice`).
FIT_ADVICE = ("Raise memory_budget, allow more techniques (techniques=('bf16', 'checkpointing', 'offload')), "
              "or shrink the model or the sequence.")

Step = Callable[[Ledger], Ledger]

# The exploring steps, in order. Without a lattice: the anchors alone, in the order given.
ANCHORS: tuple[Step, ...] = (climb_all,)
# With one: no recompute first, then compile beside it (compile's gain bounds what the recompute anchors can
# still win, so they are skipped rather than measured when they cannot), the recompute anchors, the block
# counts between them, compile again where it was not measured yet, and compile with blocks recomputed.
LATTICE: tuple[Step, ...] = (climb_without_recompute, place_compile, climb_with_recompute, place_blocks,
                             place_compile, place_compiled_recompute)
# The steps that confirm the pick (`choice.choose`) before the search is closed with its account (`choice.close`).
CONFIRM: tuple[Step, ...] = (recheck_recompute, runoff)
# The steps after the pick, in order, each refining it and recording what it found (`Ledger.found`): they run
# where the controller is given an `AfterPick`.
AFTER_PICK: tuple[Step, ...] = (offload_share, partitioned, overlap, reduce)


def run_steps(s: Ledger, steps: Sequence[Step]) -> Ledger:
    """Run `steps` in order over `s`. Once max_tune_seconds has passed (a trial refused with `OutOfTime`), the
    step in progress keeps what it measured and the rest of `steps` are skipped; the next stage still runs, so
    a pick is made from what was measured (its trials are refused at once)."""
    for step in steps:
        try:
            s = step(s)
        except OutOfTime:
            s.cut = True
            break
    return s


def stages(lattice: bool, after: bool) -> tuple[tuple[Step, ...], ...]:
    """The steps, in stages: the exploring steps (`ANCHORS`, or `LATTICE` given a lattice), the pick and the
    steps that confirm it, the search closed, and given an `AfterPick` the steps after the pick. A trial
    refused for time ends the stage it is in, never the next."""
    return (LATTICE if lattice else ANCHORS, (choose,), CONFIRM, (close,), AFTER_PICK if after else ())


class Controller:
    """The search over one workload: a `Ledger` built from the limits, and the steps run over it in order
    (`stages`)."""

    def __init__(self, runner: Runner, *, per_rank: int, limit_bytes: int, max_micro: int | None = None,
                 max_trials: int = 24, world_size: int = 1, sizes: Sequence[int] | None = None,
                 remeasure: Runner | None = None, retry: Runner | None = None, advice: str = FIT_ADVICE) -> None:
        allowed = sorted({s for s in sizes if 1 <= s <= per_rank} | {1}) if sizes else None
        self.ledger = Ledger(runner=runner, per_rank=per_rank, limit=limit_bytes, cap=per_rank,
                             max_trials=max_trials, world_size=world_size, sizes=allowed, remeasure=remeasure,
                             retry=retry, advice=advice)
        self.ledger.cap = snap(self.ledger, max(1, min(per_rank, max_micro or per_rank)))

    @property
    def trials(self) -> list[Trial]:
        """Every trial so far, in the order run (a re-measurement in its first reading's place)."""
        return self.ledger.trials

    @property
    def notes(self) -> list[str]:
        """Why configurations were left out or not tried, for the reason."""
        return self.ledger.notes

    @property
    def skipped(self) -> set[Rung]:
        """The configurations lined up that the time model ruled out unmeasured."""
        return self.ledger.skipped

    # -- top level -------------------------------------------------------------------------------------
    def search(self, rungs: Sequence[Rung], lattice: Lattice | None = None, after: AfterPick | None = None) -> Ledger:
        """Measure the anchor `rungs` in order; then, given a `lattice`, place an intermediate block count
        per offload and try compile where the measurements say they can win; pick the fastest; given `after`,
        refine the pick (`AFTER_PICK`). Cut short by the runner's `OutOfTime` (max_tune_seconds), it picks
        from what it measured. Returns the ledger: the pick (`Ledger.picked`), its account (`Ledger.head`),
        every trial, the notes, and what the steps after the pick set."""
        s = self.ledger
        s.lattice = lattice or Lattice()
        s.lined_up = list(rungs)
        s.after = after
        for steps in stages(lattice is not None, after is not None):
            s = run_steps(s, steps)
        return s

    def trials_planned(self) -> int:
        """The trials the search still plans, estimated: each configuration lined up and not yet tried at the mean
        number of trials a tried one took (at least two: a point and a prediction), and one more for the
        configuration in progress or the final re-measurement, within the trial budget."""
        tried = {t.rung for t in self.ledger.trials}
        per_rung = max(2.0, len(self.ledger.trials) / len(tried)) if tried else 2.0
        return min(max(0, self.ledger.max_trials - len(self.ledger.trials)),
                   round(untried(self.ledger) * per_rung) + 1)
