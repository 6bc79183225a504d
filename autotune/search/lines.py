"""The memory and time lines the search predicts from: bytes per sample and resident floors, micro-step seconds
per sample, each measured on one rung and lent to the rungs that treat activations alike; and the shared
search state those lines read (the rungs measured, the allowed micro-batch sizes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..configuration import WHOLE_BLOCK, Rung
from ..evidence import Trial
from ..workload.batching import ceil_div, fit_line, global_step_seconds

Runner = Callable[[Rung, int], Trial]

# Least extra time per sample a rung adds over plain BF16 (optimistic on purpose: a rung is skipped only
# when even this cannot win). Full recompute is about one more forward (~+33% of a step), and typically
# costs 10-20% of the throughput; keeping the matmuls' outputs (`recompute_policy`) reruns only elementwise work.
MIN_OVERHEAD = {"none": 0.0, "selective": 0.05, "full": 0.10, "activations": 0.15, "optimizer": 0.10,
                "saved_activations": 0.02, "save_matmuls": 0.01, "save_half_matmuls": 0.03}
MAX_PLACED = 2  # trials per offload spent placing an intermediate block count, or compile, after a miss
NOISE = 0.03  # step-time medians closer than this are a tie
RUNOFF = 0.08  # rungs whose best is this close to the leader get re-measured with a longer run
MAX_BISECT = 2  # bisection (or growth) steps per rung after a missed prediction


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


class Lines:
    """The memory and time lines of the measured rungs, and the best trial measured so far with the bound they
    set on a rung not yet measured (a part of `Controller`)."""

    per_rank: int
    world_size: int
    limit: int
    cap: int
    sizes: list[int] | None
    trials: list[Trial]
    states: list[RungState]
    lattice: Lattice

    def _best(self) -> Trial | None:
        """The fastest trial that fits, within noise of it the one with the lowest peak; None before one fits."""
        ok = [t for t in self.trials if t.fits]
        if not ok:
            return None
        fastest = max(t.samples_per_second for t in ok)
        # Within noise of the fastest, prefer headroom: the lowest peak.
        close = [t for t in ok if t.samples_per_second >= fastest * (1 - NOISE)]
        return min(close, key=lambda t: (t.peak_bytes, -t.samples_per_second))

    def _upper_bound(self, rung: Rung, states: list[RungState]) -> float | None:
        """Optimistic samples/s for `rung`, from the time model of the rung holding the best trial."""
        best = self._best()
        if best is None or (rung.fp8 and not best.rung.fp8):
            return None  # float8 matmuls shorten the step: a time model without them bounds nothing
        state = next((s for s in states if s.rung == best.rung), None)
        if state is None or len({m for m, _ in timed(state)}) < 2:
            return None  # one point gives no time model: the higher rung may still win
        _, b = fit_line(timed(state))
        # The line's slope, anchored at the largest measured micro-batch: beyond it each extra sample
        # costs at least b (b >= 0), and at it the time is what was measured, not what the fit says.
        top = max(state.ok, key=lambda t: t.micro_batch_size)
        # The optimizer step is the rung's own offload's where one was measured (optimizer offload's host
        # step is 10x the device one on GPT-2 large): a bound from another offload's would be wrong.
        opt = self._optimizer_seconds(rung.offload) or min(t.optimizer_seconds for t in state.ok)
        extra, base_extra = min_overhead(rung), min_overhead(best.rung)
        micro_seconds = ((top.step_seconds + max(b, 0.0) * (self.cap - top.micro_batch_size))
                         * (1 + extra) / (1 + base_extra))
        per_step = global_step_seconds(micro_seconds, opt, self.per_rank, self.cap)
        return self.per_rank * self.world_size / per_step

    def _slope(self, rung: Rung) -> float | None:
        """Measured bytes per sample for `rung`'s treatment of activations (two sizes or more), or None."""
        # The rung's own offload first: the same activations can measure a different slope at the larger
        # micro-batches optimizer offload reaches, and the compile saving is judged against that one.
        for other in sorted(self.states, key=lambda s: s.rung.offload != rung.offload):
            points = [(t.micro_batch_size, t.peak_bytes) for t in other.trials if t.outcome in ("ok", "over_budget")]
            if activations(other.rung) == activations(rung) and len({m for m, _ in points}) >= 2:
                _, slope = fit_line(points)
                return slope if slope > 0 else None
        return None

    def _floor(self, rung: Rung) -> float | None:
        """`rung`'s resident floor: measured on a rung with the same floor (the intercept under a known
        slope), else a measured sibling's shifted by the arithmetic difference of the two floors."""
        floors = self.lattice.floors
        # A measured floor of the same offload beats one shifted by arithmetic from a sibling's.
        for other in sorted(self.states, key=lambda s: (s.rung.optimizer_8bit != rung.optimizer_8bit,
                                                         s.rung.offload != rung.offload)):
            slope = self._slope(other.rung)
            ran = [t for t in other.trials if t.outcome in ("ok", "over_budget")]
            if slope is None or not ran:
                continue
            top = max(ran, key=lambda t: t.micro_batch_size)
            measured = top.peak_bytes - slope * top.micro_batch_size
            same_state = other.rung.optimizer_8bit == rung.optimizer_8bit  # 8-bit state: a smaller floor
            if same_state and (other.rung.offload == rung.offload
                               or (other.rung.offload != "optimizer") == (rung.offload != "optimizer")):
                return measured
            if rung in floors and other.rung in floors:
                return measured + floors[rung] - floors[other.rung]
        return None

    def _predicted_reach(self, rung: Rung) -> int | None:
        """The largest micro-batch `rung` should fit by the measured memory line, or None if unknown."""
        slope, floor = self._slope(rung), self._floor(rung)
        if slope is None or floor is None:
            return None
        return max(0, math.floor((self.limit - floor) / slope))

    def _step_line(self, rung: Rung) -> tuple[float, float] | None:
        """Micro-step seconds ~ a + b x m on the rung, or on one that treats activations alike; one timed
        size gives a line through the origin (every second proportional to the samples: optimistic)."""
        for state in sorted(self.states, key=lambda s: s.rung != rung):
            points = timed(state)
            if activations(state.rung) != activations(rung) or not points:
                continue
            if len({m for m, _ in points}) >= 2:
                a, b = fit_line(points)
                return max(a, 0.0), max(b, 0.0)
            m, s = points[0]
            return 0.0, s / m
        return None

    def _optimizer_seconds(self, offload: str) -> float | None:
        times = [t.optimizer_seconds for t in self.trials if t.fits and t.rung.offload == offload]
        return min(times) if times else None

    def _sizes(self) -> list[int]:
        """One micro-batch per accumulation count (the smallest for it: same speed, most headroom)."""
        return sorted({self._snap(balanced(m, self.per_rank)) for m in range(1, self.cap + 1)})

    def _snap(self, micro: int) -> int:
        """The largest allowed micro-batch not above `micro` (any size when `sizes` was not given)."""
        if self.sizes is None:
            return micro
        return max(s for s in self.sizes if s <= max(1, micro))

    def _state(self, rung: Rung) -> RungState:
        for state in self.states:
            if state.rung == rung:
                return state
        state = RungState(rung=rung)
        self.states.append(state)
        return state


def balanced(micro: int, per_rank: int) -> int:
    """The smallest micro-batch needing as few accumulation steps as `micro`: same speed, more headroom."""
    steps = ceil_div(per_rank, max(1, micro))
    return ceil_div(per_rank, steps)


@dataclass(frozen=True, kw_only=True)
class Compiled:
    """What compile did beside an eager trial at the same size: bytes per sample and step time, as ratios."""

    memory: float
    time: float


def activations(rung: Rung) -> tuple[str, str, int | None, str, bool, str]:
    """What sets the bytes each sample adds: precision, blocks recomputed and what they keep, compile,
    activation offload."""
    offload = "none" if rung.offload == "optimizer" else rung.offload
    return rung.precision, rung.checkpointing, rung.checkpointed_blocks, rung.recompute_policy, rung.compile, offload


def min_overhead(rung: Rung) -> float:
    """The least extra time per sample `rung` adds over plain BF16 (`MIN_OVERHEAD`): its offload's, else its
    recompute's."""
    if rung.offload != "none":
        return MIN_OVERHEAD[rung.offload]
    return MIN_OVERHEAD[rung.checkpointing if rung.recompute_policy == WHOLE_BLOCK else rung.recompute_policy]


def timed(state: RungState) -> list[tuple[int, float]]:
    """(micro-batch, micro-step seconds) of every trial that ran all its steps, over the limit or not."""
    return [(t.micro_batch_size, t.step_seconds) for t in state.trials
            if t.outcome in ("ok", "over_budget") and t.step_seconds > 0]
