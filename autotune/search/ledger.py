"""`Ledger`: the one state the search's steps share, from the first anchor trial to the pick: the limits it runs
under, every trial, the state of each configuration measured, the notes for the reason, and what the steps
learned on the way (the micro-batch floor, what compile saves). Each step (`climb.py`, `compile_beside.py`,
`blocks.py`, `compiled_recompute.py`, `recheck.py`, `runoff.py`, `choice.py`) takes it and returns it refined.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..configuration import Rung
from ..evidence import Trial

Runner = Callable[[Rung, int], Trial]


@dataclass(frozen=True, kw_only=True)
class Lattice:
    """What the search may place beyond the anchor configurations it is given.

    `blocks` is N, the repeated blocks checkpointing can recompute (0: no such knob); `compile` says
    whether compiled configurations may be tried; `floors` is each anchor's resident floor by memory
    arithmetic (weights, gradients, optimizer state on the device), which predicts a rung's measured
    floor from a sibling's: the arithmetic difference is exact for what moves to the host.
    """

    blocks: int = 0
    compile: bool = False
    floors: dict[Rung, int] = field(default_factory=dict)
    shares: tuple[float, ...] | None = None  # share of the recompute's saving the first k blocks give, k=0..N
    # (blocks are recomputed largest first, so more than k/N); None: k/N


@dataclass(kw_only=True)
class RungState:
    """The trials of one rung, and where its micro-batches fitted and did not."""

    rung: Rung
    trials: list[Trial] = field(default_factory=list)

    @property
    def ok(self) -> list[Trial]:
        return [t for t in self.trials if t.fits]

    @property
    def smallest_bad(self) -> int | None:
        bad = [t.micro_batch_size for t in self.trials if not t.fits]
        return min(bad) if bad else None

    @property
    def largest_ok(self) -> int | None:
        ok = [t.micro_batch_size for t in self.ok]
        return max(ok) if ok else None


@dataclass(frozen=True, kw_only=True)
class Compiled:
    """What compile did beside an eager trial at the same size: bytes per sample and step time, as ratios."""

    memory: float
    time: float


@dataclass(kw_only=True)
class Ledger:
    """The search's state: its limits and runners, and everything measured and decided so far.

    Large: one field per fact the steps share. The limits (first block) are set once by the controller; the
    rest grows as the steps run, and every step reads most of it (the trials and rung states, the floor, the
    notes), so splitting it would make each step reach through several objects for one decision.
    """

    # -- the limits and runners, set once ----------------------------------------------------------------
    runner: Runner
    per_rank: int
    limit: int  # bytes a trial's peak may reach
    cap: int  # the largest micro-batch tried
    max_trials: int
    world_size: int = 1
    sizes: list[int] | None = None  # the micro-batches allowed (`autotune run`), or None: any
    remeasure: Runner | None = None  # a longer-running runner for the runoff and the recheck; None skips them
    # Measures a trial in doubt again (search/noise.py), on the CPU where another process can take the cores
    # mid-trial; None: every reading stands (on a GPU, where the device times the steps).
    retry: Runner | None = None
    advice: str = ""  # the last sentence of the error when nothing fits
    lattice: Lattice = field(default_factory=Lattice)
    lined_up: list[Rung] = field(default_factory=list)  # the configurations the search set out to measure
    # -- what the steps measured and decided -------------------------------------------------------------
    trials: list[Trial] = field(default_factory=list)
    states: list[RungState] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # for the reason: what was left out, and why
    skipped: set[Rung] = field(default_factory=set)  # of those lined up, the ones ruled out unmeasured
    settled: set[tuple[Rung, int]] = field(default_factory=set)  # (rung, micro-batch) measured again: once each
    smallest: int = 1  # fewest samples a micro-batch may hold: 2 once batch statistics refused 1
    floor: int = 1  # the smallest micro-batch tried: no split of per_rank at it holds fewer than `smallest`
    floor_note: str = ""  # why micro-batch 1 was skipped, once it was
    compiled: Compiled | None = None  # what compile saved beside eager, once measured
    compiled_recompute: Compiled | None = None  # the same with blocks recomputed, once measured
    compile_failed: bool = False
    cut: bool = False  # max_tune_seconds stopped it (`deadline.OutOfTime`)
    pick: Trial | None = None  # the configuration chosen, once the exploring steps are done

    def picked(self) -> Trial:
        """The pick, for the steps after `choice.choose`; one run before it is a wrong order of steps."""
        if self.pick is None:
            raise RuntimeError("no pick yet: the steps that confirm a pick run after choice.choose")
        return self.pick
