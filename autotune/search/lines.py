"""The memory and time lines the search predicts from: bytes per sample and resident floors, micro-step seconds
per sample, each measured on one rung and lent to the rungs that treat activations alike; the best trial
measured so far with the bound those lines set on a rung not yet measured; and the allowed micro-batch sizes.
Each is a question asked of the search's `Ledger`; none runs a trial.
"""

from __future__ import annotations

import math

from ..configuration import WHOLE_BLOCK, Rung
from ..evidence import Trial
from ..workload.batching import ceil_div, fit_line, global_step_seconds
from .ledger import Compiled, Lattice, Ledger, RungState, Runner

__all__ = ["MAX_BISECT", "MAX_PLACED", "MIN_OVERHEAD", "NOISE", "RUNOFF", "Compiled", "Lattice", "RungState",
           "Runner", "accumulation_sizes", "activations", "balanced", "best_so_far", "bytes_per_sample",
           "min_overhead", "optimizer_seconds", "predicted_reach", "resident_floor", "rung_state", "snap",
           "step_line", "timed", "upper_bound"]

# Least extra time per sample a rung adds over plain BF16 (optimistic on purpose: a rung is skipped only
# when even this cannot win). Full recompute is about one more forward (~+33% of a step), and typically
# costs 10-20% of the throughput; keeping the matmuls' outputs (`recompute_policy`) reruns only elementwise work.
MIN_OVERHEAD = {"none": 0.0, "selective": 0.05, "full": 0.10, "activations": 0.15, "optimizer": 0.10,
                "saved_activations": 0.02, "save_matmuls": 0.01, "save_half_matmuls": 0.03}
MAX_PLACED = 2  # trials per offload spent placing an intermediate block count, or compile, after a miss
NOISE = 0.03  # step-time medians closer than this are a tie
RUNOFF = 0.08  # rungs whose best is this close to the leader get re-measured with a longer run
MAX_BISECT = 2  # bisection (or growth) steps per rung after a missed prediction


def best_so_far(s: Ledger) -> Trial | None:
    """The fastest trial that fits, within noise of it the one with the lowest peak; None before one fits."""
    ok = [t for t in s.trials if t.fits]
    if not ok:
        return None
    fastest = max(t.samples_per_second for t in ok)
    # Within noise of the fastest, prefer headroom: the lowest peak.
    close = [t for t in ok if t.samples_per_second >= fastest * (1 - NOISE)]
    return min(close, key=lambda t: (t.peak_bytes, -t.samples_per_second))


def upper_bound(s: Ledger, rung: Rung, states: list[RungState]) -> float | None:
    """Optimistic samples/s for `rung`, from the time model of the rung holding the best trial."""
    best = best_so_far(s)
    if best is None or (rung.fp8 and not best.rung.fp8):
        return None  # float8 matmuls shorten the step: a time model without them bounds nothing
    state = next((st for st in states if st.rung == best.rung), None)
    if state is None or len({m for m, _ in timed(state)}) < 2:
        return None  # one point gives no time model: the higher rung may still win
    _, b = fit_line(timed(state))
    # The line's slope, anchored at the largest measured micro-batch: beyond it each extra sample
    # costs at least b (b >= 0), and at it the time is what was measured, not what the fit says.
    top = max(state.ok, key=lambda t: t.micro_batch_size)
    # The optimizer step is the rung's own offload's where one was measured (optimizer offload's host
    # step is 10x the device one on GPT-2 large): a bound from another offload's would be wrong.
    opt = optimizer_seconds(s, rung.offload) or min(t.optimizer_seconds for t in state.ok)
    extra, base_extra = min_overhead(rung), min_overhead(best.rung)
    micro_seconds = ((top.step_seconds + max(b, 0.0) * (s.cap - top.micro_batch_size))
                     * (1 + extra) / (1 + base_extra))
    per_step = global_step_seconds(micro_seconds, opt, s.per_rank, s.cap)
    return s.per_rank * s.world_size / per_step


def bytes_per_sample(s: Ledger, rung: Rung) -> float | None:
    """Measured bytes per sample for `rung`'s treatment of activations (two sizes or more), or None."""
    # The rung's own offload first: the same activations can measure a different slope at the larger
    # micro-batches optimizer offload reaches, and the compile saving is judged against that one.
    for other in sorted(s.states, key=lambda st: st.rung.offload != rung.offload):
        points = [(t.micro_batch_size, t.peak_bytes) for t in other.trials if t.outcome in ("ok", "over_budget")]
        if activations(other.rung) == activations(rung) and len({m for m, _ in points}) >= 2:
            _, slope = fit_line(points)
            return slope if slope > 0 else None
    return None


def resident_floor(s: Ledger, rung: Rung) -> float | None:
    """`rung`'s resident floor: measured on a rung with the same floor (the intercept under a known
    slope), else a measured sibling's shifted by the arithmetic difference of the two floors."""
    floors = s.lattice.floors
    # A measured floor of the same offload beats one shifted by arithmetic from a sibling's.
    for other in sorted(s.states, key=lambda st: (st.rung.optimizer_8bit != rung.optimizer_8bit,
                                                    st.rung.offload != rung.offload)):
        slope = bytes_per_sample(s, other.rung)
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


def predicted_reach(s: Ledger, rung: Rung) -> int | None:
    """The largest micro-batch `rung` should fit by the measured memory line, or None if unknown."""
    slope, floor = bytes_per_sample(s, rung), resident_floor(s, rung)
    if slope is None or floor is None:
        return None
    return max(0, math.floor((s.limit - floor) / slope))


def step_line(s: Ledger, rung: Rung) -> tuple[float, float] | None:
    """Micro-step seconds ~ a + b x m on the rung, or on one that treats activations alike; one timed
    size gives a line through the origin (every second proportional to the samples: optimistic)."""
    for state in sorted(s.states, key=lambda st: st.rung != rung):
        points = timed(state)
        if activations(state.rung) != activations(rung) or not points:
            continue
        if len({m for m, _ in points}) >= 2:
            a, b = fit_line(points)
            return max(a, 0.0), max(b, 0.0)
        m, seconds = points[0]
        return 0.0, seconds / m
    return None


def optimizer_seconds(s: Ledger, offload: str) -> float | None:
    times = [t.optimizer_seconds for t in s.trials if t.fits and t.rung.offload == offload]
    return min(times) if times else None


def accumulation_sizes(s: Ledger) -> list[int]:
    """One micro-batch per accumulation count (the smallest for it: same speed, most headroom)."""
    return sorted({snap(s, balanced(m, s.per_rank)) for m in range(1, s.cap + 1)})


def snap(s: Ledger, micro: int) -> int:
    """The largest allowed micro-batch not above `micro` (any size when `sizes` was not given)."""
    if s.sizes is None:
        return micro
    return max(size for size in s.sizes if size <= max(1, micro))


def rung_state(s: Ledger, rung: Rung) -> RungState:
    for state in s.states:
        if state.rung == rung:
            return state
    state = RungState(rung=rung)
    s.states.append(state)
    return state


def balanced(micro: int, per_rank: int) -> int:
    """The smallest micro-batch needing as few accumulation steps as `micro`: same speed, more headroom."""
    steps = ceil_div(per_rank, max(1, micro))
    return ceil_div(per_rank, steps)


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
