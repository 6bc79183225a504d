"""The search over one workload, as ordered steps over one `Ledger` (search/ledger.py): which trial runs next,
and which measured configuration wins. Each step is a function in its own module that takes the ledger and
returns it, having made one decision:

1. `climb.py`: which anchor rungs are measured, each explored in order (`explore.py`: two points, a prediction
   from the memory line, a verification, bisection or growth only after a miss), skipped where the time model
   of the best so far says it cannot win (time per micro-step ~ a + b x m; a higher rung lets the micro-batch
   grow, but costs at least its recompute/copy overhead per sample).
2. With a lattice: `compile_beside.py` (whether compile pays, beside the fastest eager configuration without
   recompute), the climb over the recompute anchors, `blocks.py` (how many blocks to recompute between them),
   and `compiled_recompute.py` (compile with blocks recomputed); each places what the measured lines
   (`lines.py`, `placement.py`) predict can win and verifies it with trials (`measure.py`).
3. `choice.py`: the pick, the fastest whole global step, within noise the one with more headroom; or
   `NoFeasiblePlan`.
4. `recheck.py`, `runoff.py`: a win more work cannot explain, and close leaders, measured again longer.
5. `choice.reason`: the account of the pick.

The controller takes the trial runner as an argument, so tests drive it with scripted fakes. `sizes` restricts
the micro-batches tried (zero-change trials of `autotune run` need divisors of the per-rank batch, since the
script does its own batching): every size asked for is snapped down to an allowed one, and growth moves to the
next allowed size when snapping would stand still.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..configuration import Rung
from ..evidence import Trial
from .blocks import place_blocks
from .choice import choose, reason
from .climb import climb_all, climb_with_recompute, climb_without_recompute
from .compile_beside import place_compile
from .compiled_recompute import place_compiled_recompute
from .deadline import OutOfTime
from .ledger import Lattice, Ledger, Runner
from .lines import NOISE, best_so_far, snap
from .placement import ruled_out, with_room
from .recheck import recheck_recompute
from .runoff import runoff

__all__ = ["ANCHORS", "CONFIRM", "FIT_ADVICE", "LATTICE", "NOISE", "Controller", "Lattice", "SearchResult", "Step",
           "ruled_out", "run_steps"]


@dataclass(kw_only=True)
class SearchResult:
    """The controller's pick, every trial it ran, its account of the pick, and the notes on what it left out."""

    best: Trial
    trials: list[Trial]
    reason: str
    notes: list[str] = field(default_factory=list)
    smallest: int = 1  # the fewest samples a micro-batch may hold (2 when batch statistics need them)
    floor_note: str = ""  # why micro-batch 1 was skipped (also first in `notes`), or ""
    cut: bool = False  # max_tune_seconds stopped the search before it ran to its end


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
# The steps that confirm the pick (`choice.choose`) before its reason is composed.
CONFIRM: tuple[Step, ...] = (recheck_recompute, runoff)


def run_steps(s: Ledger, steps: Sequence[Step]) -> Ledger:
    """Run `steps` in order over `s`. Once max_tune_seconds has passed (a trial refused with `OutOfTime`), the
    step in progress keeps what it measured, the rest are skipped, and a pick already made is the best measured
    (a recheck cut short has replaced some trials)."""
    for step in steps:
        try:
            s = step(s)
        except OutOfTime:
            s.cut = True
            if s.pick is not None:
                s.pick = best_so_far(s) or s.pick
            break
    return s


class Controller:
    """The search over one workload: a `Ledger` built from the limits, and the steps run over it in order
    (`ANCHORS` or `LATTICE`, then `choice.choose`, then `CONFIRM`)."""

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
    def search(self, rungs: Sequence[Rung], lattice: Lattice | None = None) -> SearchResult:
        """Measure the anchor `rungs` in order; then, given a `lattice`, place an intermediate block count
        per offload and try compile where the measurements say they can win; pick the fastest. Cut short by
        the runner's `OutOfTime` (max_tune_seconds), it picks from what it measured."""
        s = self.ledger
        s.lattice = lattice or Lattice()
        s.lined_up = list(rungs)
        s = run_steps(s, ANCHORS if lattice is None else LATTICE)
        s = run_steps(choose(s), CONFIRM)
        best = s.picked()
        return SearchResult(best=best, trials=list(s.trials), reason=reason(s, best), notes=s.notes,
                            smallest=s.smallest, floor_note=s.floor_note, cut=s.cut)

    def with_room(self, like: Rung, freed: float) -> list[tuple[Rung, int, float]]:
        """What `like`'s offload and compile would fit with `freed` more bytes, fastest first
        (`placement.with_room`)."""
        return with_room(self.ledger, like, freed)

    def untried(self) -> int:
        """How many of the configurations the search lined up have no trial yet and were not ruled out."""
        tried = {t.rung for t in self.ledger.trials} | self.ledger.skipped
        return sum(r not in tried for r in dict.fromkeys(self.ledger.lined_up))

    def trials_planned(self) -> int:
        """The trials the search still plans, estimated: each configuration lined up and not yet tried at the mean
        number of trials a tried one took (at least two: a point and a prediction), and one more for the
        configuration in progress or the final re-measurement, within the trial budget."""
        tried = {t.rung for t in self.ledger.trials}
        per_rung = max(2.0, len(self.ledger.trials) / len(tried)) if tried else 2.0
        return min(max(0, self.ledger.max_trials - len(self.ledger.trials)), round(self.untried() * per_rung) + 1)
