"""The decision graph: which trial to run next, and which measured configuration wins.

Per rung: measure two micro-batch sizes, predict from the memory slope the largest that keeps the peak
under the limit, verify it with one trial, and refine only when the prediction missed: bisect after it
went over, re-predict from the local slope when it fitted with room to spare; no refining trial runs
that the rung's time model says cannot beat the best measured so far by more than noise. Across rungs:
climb while a higher rung can still beat the best measured so far, judged from the time model of the
best rung (time per micro-step ~ a + b x m): a higher rung lets the micro-batch grow, but costs at
least its recompute/copy overhead per sample, so it cannot beat `per_rank / (a + (1 + overhead) x b x
per_rank + optimizer)`. The winner is the fastest whole global step; within noise, the one with more
headroom. The controller takes the trial runner as an argument, so tests drive it with scripted fakes.

`sizes` restricts the micro-batches tried (zero-change trials of `autotune run` need divisors of the
per-rank batch, since the script does its own batching): every size asked for is snapped down to an
allowed one, and growth moves to the next allowed size when snapping would stand still.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..configuration import Rung
from ..errors import NoFeasiblePlan
from ..evidence import Trial
from .choice import Choice
from .deadline import OutOfTime
from .lines import NOISE, Compiled, Lattice, RungState, Runner
from .placement import Placing, ruled_out

__all__ = ["Controller", "FIT_ADVICE", "Lattice", "NOISE", "SearchResult", "ruled_out"]



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


class Controller(Placing, Choice):
    """The search over one workload: the climb (`climb.py`), the lattice placement (`placement.py`), the
    memory and time lines (`lines.py`) and the choice with its reason (`choice.py`).

    Large: the count takes in those four parts. They are one object because each reads and extends the same
    measurements: the trials, the state of each rung measured, the notes for the reason, and the limits
    the search runs under (the budget, the micro-batch cap and floor, the trial budget). Each part lives in
    its own file; the search as ordered steps over one search state, each step a module, would replace the
    parts.
    """

    def __init__(self, runner: Runner, *, per_rank: int, limit_bytes: int, max_micro: int | None = None,
                 max_trials: int = 24, world_size: int = 1, sizes: Sequence[int] | None = None,
                 remeasure: Runner | None = None, retry: Runner | None = None, advice: str = FIT_ADVICE) -> None:
        self.runner = runner
        self.advice = advice  # the last sentence of the error when nothing fits
        self.remeasure = remeasure  # a longer-running runner for the final runoff; None skips it
        # Measures a trial in doubt again (search/noise.py), on the CPU where another process can take the
        # cores mid-trial; None: every reading stands (on a GPU, where the device times the steps).
        self.retry = retry
        self._settled: set[tuple[Rung, int]] = set()
        self.per_rank = per_rank
        self.limit = limit_bytes
        self.sizes = sorted({s for s in sizes if 1 <= s <= per_rank} | {1}) if sizes else None
        self.cap = self._snap(max(1, min(per_rank, max_micro or per_rank)))
        self.max_trials = max_trials
        self.world_size = world_size
        self.trials: list[Trial] = []
        self.states: list[RungState] = []
        self.notes: list[str] = []
        self.lattice = Lattice()
        self._compiled: Compiled | None = None  # what compile saved beside eager, once measured
        self._compiled_recompute: Compiled | None = None  # the same with blocks recomputed, once measured
        self._compile_failed = False
        self.smallest = 1  # fewest samples a micro-batch may hold: 2 once batch statistics refused 1
        self.floor = 1  # the smallest micro-batch tried: no split of per_rank at it holds fewer than `smallest`
        self.floor_note = ""  # why micro-batch 1 was skipped, once it was
        self.lined_up: list[Rung] = []  # the configurations the search set out to measure
        self.skipped: set[Rung] = set()  # of those, the ones the time model ruled out unmeasured
        self.cut = False  # max_tune_seconds stopped it (`deadline.OutOfTime`)

    # -- top level -------------------------------------------------------------------------------------
    def search(self, rungs: Sequence[Rung], lattice: Lattice | None = None) -> SearchResult:
        """Measure the anchor `rungs` in order; then, given a `lattice`, place an intermediate block count
        per offload and try compile where the measurements say they can win; pick the fastest. Cut short by
        the runner's `OutOfTime` (max_tune_seconds), it picks from what it measured."""
        self.lattice = lattice or Lattice()
        self.lined_up = list(rungs)
        try:
            self._explore_all(rungs, lattice)
        except OutOfTime:
            self.cut = True
        best = self._best()
        if best is None:
            raise NoFeasiblePlan(self._nothing_fits(rungs), tuple(self.trials))
        try:
            best = self._recheck_recompute(best)
            best = self._runoff(best)
        except OutOfTime:
            self.cut = True
            best = self._best() or best
        return SearchResult(best=best, trials=list(self.trials), reason=self._reason(best), notes=self.notes,
                            smallest=self.smallest, floor_note=self.floor_note, cut=self.cut)

    def _explore_all(self, rungs: Sequence[Rung], lattice: Lattice | None) -> None:
        if lattice is None:
            self._climb(rungs)
            return
        # No recompute first, then compile beside it: compile's gain bounds what the recompute rungs
        # can still win, so they are skipped rather than measured when they cannot.
        self._climb([r for r in rungs if r.checkpointed_blocks == 0])
        self._place_compile()
        self._climb([r for r in rungs if r.checkpointed_blocks != 0])
        self._place_blocks()
        self._place_compile()
        self._place_compiled_recompute()

    def untried(self) -> int:
        """How many of the configurations the search lined up have no trial yet and were not ruled out."""
        tried = {t.rung for t in self.trials} | self.skipped
        return sum(r not in tried for r in dict.fromkeys(self.lined_up))

    def trials_planned(self) -> int:
        """The trials the search still plans, estimated: each configuration lined up and not yet tried at the mean
        number of trials a tried one took (at least two: a point and a prediction), and one more for the
        configuration in progress or the final re-measurement, within the trial budget."""
        tried = {t.rung for t in self.trials}
        per_rung = max(2.0, len(self.trials) / len(tried)) if tried else 2.0
        return min(max(0, self.max_trials - len(self.trials)), round(self.untried() * per_rung) + 1)
