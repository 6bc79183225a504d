"""`Ledger`: the one state the search's steps share, from the first anchor trial to the plan: the limits it runs
under, every trial, the state of each configuration measured, the notes for the reason, what the steps learned
on the way (the micro-batch floor, what compile saves), the pick, and what the steps after the pick set on it
(the host share, the overlaps) and found. Each step (`climb.py`, `compile_beside.py`, `blocks.py`,
`compiled_recompute.py`, `choice.py`, `recheck.py`, `runoff.py`, then `offload_share.py`,
`partitioned_state.py`, `offload_overlap.py`, `reduce_timing.py`) takes it and returns it refined.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..configuration import Rung
from ..evidence import Finding, Trial

if TYPE_CHECKING:
    from .trial import Workload

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


@dataclass(frozen=True, kw_only=True)
class AfterPick:
    """What the steps after the pick run with beyond the ledger: the trial runner with its keyword options
    (`TrialRunner`'s call: a host share, an overlap, a sharding, longer runs), the workload, whether the model
    is FSDP2-sharded, the techniques allowed, and the rungs whose whole optimizer the host cannot hold, with
    the host share their trials ran at (`host_budget.keep_within`)."""

    run: Callable[..., Trial]
    work: Workload
    sharded: bool
    allowed: frozenset[str]
    host_shares: dict[Rung, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class Ledger:
    """The search's state: its limits and runners, and everything measured and decided so far.

    Large: one field per fact the steps share, from the first anchor to the plan. The limits (first block) are
    set once by the controller; the rest grows as the steps run, and every step reads most of it (the trials
    and rung states, the floor, the notes, the pick), so splitting it, or handing the steps after the pick a
    second state, would make each step reach through several objects for one decision.
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
    after: AfterPick | None = None  # what the steps after the pick run with; None: no such steps (`autotune run`)
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
    cut: bool = False  # max_tune_seconds stopped a step (`deadline.OutOfTime`), or the trial at the example's length
    pick: Trial | None = None  # the configuration chosen, once the exploring steps are done; the plan's
    # -- the search closed (`choice.close`), and what the steps after the pick set and found ----------------
    head: str = ""  # the account of the search's pick (`choice.reason`)
    untried: int = 0  # configurations the search lined up and neither measured nor ruled out
    fraction: float | None = None  # `plan.offload_fraction`; None: the whole optimizer or none offloaded
    overlap: bool | None = None  # `plan.offload_overlap`
    reduce_overlap: bool | None = None  # `plan.reduce_overlap`
    findings: list[Finding] = field(default_factory=list)  # for the reason, in the order found

    def picked(self) -> Trial:
        """The pick, for the steps after `choice.choose`; one run before it is a wrong order of steps."""
        if self.pick is None:
            raise RuntimeError("no pick yet: the steps that confirm a pick run after choice.choose")
        return self.pick

    def afterwards(self) -> AfterPick:
        """What the steps after the pick run with; one run on a ledger without it is a wrong list of steps."""
        if self.after is None:
            raise RuntimeError("no AfterPick: the steps after the pick run only where the controller was given one")
        return self.after

    def found(self, phase: str, clause: str, *, leads: bool = False) -> None:
        """Record what a step after the pick found, for the plan's reason: a clause after the account of the pick,
        or, where the step replaced the pick, one before it (`leads`: "clause; then: ...")."""
        self.findings.append(Finding(kind=phase, clause=clause, place="leads" if leads else "after"))
