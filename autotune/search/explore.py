"""Exploring one rung: two points, a prediction, a verification; bisection or growth only after a miss, and no
refining trial that the rung's own time model says cannot beat the best measured so far. The climb
(`climb.py`) runs it on each anchor; the placing steps grow or bisect the configurations they place with it."""

from __future__ import annotations

import math

from ..workload.batching import (
    bisect_next,
    ceil_div,
    fit_line,
    global_step_seconds,
    predict_max_micro_batch,
)
from .ledger import Ledger, RungState
from .lines import (
    MAX_BISECT,
    NOISE,
    accumulation_sizes,
    balanced,
    best_so_far,
    bytes_per_sample,
    predicted_reach,
    snap,
)
from .measure import budget_left, measure
from .offload_bound import cannot_win


def explore(s: Ledger, state: RungState, previous: RungState | None) -> None:
    """Two points, a prediction, a verification; bisection only after a miss.

    A higher rung saves memory, so it starts at the largest micro-batch the rung below fitted and
    probes next the smallest that did not fit there: the one question this rung has to answer. A rung
    whose per-sample memory is already known (see `borrowed_slope`) skips the probe and predicts.
    """
    start = previous.largest_ok or 1 if previous is not None else 1
    reach = predicted_reach(s, state.rung)
    if reach is not None:  # memory arithmetic from the measured siblings beats a guess from the last rung
        start = max(1, snap(s, balanced(min(reach, s.cap), s.per_rank)))
    first = measure(s, state, min(start, s.cap))
    if not first.fits and first.micro_batch_size > s.floor:
        first = measure(s, state, s.floor)
    if not first.fits or first.micro_batch_size >= s.cap:
        return
    beaten = cannot_win(s, state.rung, first)  # offloading: growing it past its base's reach wins nothing
    if beaten is not None:
        s.notes.append(beaten)
        return
    slope = borrowed_slope(s, state)
    if slope is not None:
        reach = first.micro_batch_size + math.floor((s.limit - first.peak_bytes) / slope)
        guess = snap(s, min(s.cap, balanced(reach, s.per_rank)))
        if guess > first.micro_batch_size:
            verify(s, state, guess)
        return
    probe = previous.smallest_bad if previous is not None else None
    if probe is None or probe <= first.micro_batch_size:
        probe = 2 * first.micro_batch_size
    probe = balanced_probe(s, first.micro_batch_size, probe)
    if probe is None:  # the first is the largest balanced size under the cap
        return
    second = measure(s, state, probe)
    if not second.fits:
        bisect(s, state)
        return
    if second.micro_batch_size >= s.cap:
        return
    points = [(t.micro_batch_size, t.peak_bytes) for t in state.trials if t.outcome != "oom"]
    guess = balanced(predict_max_micro_batch(points, s.limit, s.cap), s.per_rank)
    if guess > second.micro_batch_size and budget_left(s):
        verify(s, state, guess)


def balanced_probe(s: Ledger, first: int, probe: int) -> int | None:
    """The size to probe after `first`: the largest balanced one (`accumulation_sizes`) up to `probe`, else the
    smallest above `first`; None where no allowed size above `first` runs fewer micro-steps (a cap just under the
    batch: every size over half of it runs two, as half does). An unbalanced size is charged for micro-steps a
    balanced one with as many would run at fewer samples (20 of 64 takes four micro-steps, as 16 does), so it
    scores the rung below its speed, and the probe's answer, whether the rung fits there, is the same at the
    balanced size."""
    sizes = [m for m in accumulation_sizes(s) if m > first]
    if not sizes:  # no allowed size above `first` (see `sizes`) within the cap: the next allowed one above
        return next((size for size in s.sizes or () if first < size <= s.cap), None)
    return max((m for m in sizes if m <= probe), default=sizes[0])


def verify(s: Ledger, state: RungState, guess: int) -> None:
    """Run the predicted micro-batch; then narrow down if it did not fit, or grow if it left room."""
    if measure(s, state, guess).fits:
        grow(s, state)
    else:
        bisect(s, state)


def borrowed_slope(s: Ledger, state: RungState) -> float | None:
    """Bytes per sample of another measured rung that treats activations the same way, or None.

    Optimizer offload moves weights and optimizer state, a fixed cost; what each sample adds is set by
    precision, recompute and compile alone, so a rung with the same of those has measured it already
    (over a wider range than a second point here would: on GPT-2 large, 2 to 8 samples).
    """
    if state.rung.offload != "optimizer":
        return None
    return bytes_per_sample(s, state.rung)


def grow(s: Ledger, state: RungState) -> None:
    """The prediction fitted: a miss on the low side if the line now says more fits.

    Peaks at small micro-batches are mostly fixed costs (cuDNN workspaces, allocator rounding), so the
    first two points can make the slope far too steep (on a ResNet, micro-batch 1 and 2 can predict a
    third of what fits). Re-predict from the two largest points, the local slope near the edge, while that
    saves accumulation steps.

    Where memory does not grow with the micro-batch (the line is flat: fixed costs swamp the activations),
    the line predicts nothing and each step doubles the micro-batch; such steps are growth, not refinement,
    and go on while the time line says they pay (`worth_trying`), up to the per-rank batch.
    """
    refined = 0
    while refined < MAX_BISECT:
        lo = state.largest_ok
        if lo is None or lo >= s.cap or not budget_left(s):
            return
        points = sorted((t.micro_batch_size, t.peak_bytes) for t in state.trials if t.outcome != "oom")[-2:]
        guess = snap(s, balanced(predict_max_micro_batch(points, s.limit, s.cap), s.per_rank))
        if guess <= lo or ceil_div(s.per_rank, guess) == ceil_div(s.per_rank, lo):
            return  # no larger micro-batch saves an accumulation step
        if not worth_trying(s, state, guess):
            return
        if not measure(s, state, guess).fits:
            bisect(s, state)
            return
        refined += fit_line(points)[1] > 0  # a doubling on a flat line is not a refinement


def bisect(s: Ledger, state: RungState) -> None:
    """Narrow the gap between the largest micro-batch that fits and the smallest that does not.

    When the failure ran to the end (over the limit, not an OOM) its peak and the largest fitting
    one bracket the edge: the line between them says where the limit falls, and when it falls below
    the next size up nothing in between is tried (no trial is spent to learn that a size between ran
    over). After an OOM only the midpoint is known to be safe.
    """
    for _ in range(MAX_BISECT):
        lo, hi = state.largest_ok, state.smallest_bad
        if lo is None or hi is None or not budget_left(s):
            return
        mid = bisect_next(lo, hi)
        if mid is None:
            return
        edge = edge_between(s, state, lo, hi)
        if edge is not None:
            if edge <= lo:
                return
            mid = min(hi - 1, edge)
        mid = snap(s, max(lo + 1, balanced(mid, s.per_rank)))
        if mid <= lo or mid >= hi or ceil_div(s.per_rank, mid) == ceil_div(s.per_rank, lo):
            return  # no micro-batch between them saves an accumulation step
        if not worth_trying(s, state, mid):
            return
        measure(s, state, mid)


def edge_between(s: Ledger, state: RungState, lo: int, hi: int) -> int | None:
    """The largest micro-batch under the limit on the line through the peaks at `lo` (fitted) and `hi`
    (ran over the limit); None when `hi` ran out of memory, so its peak is unknown."""
    below = next(t for t in state.trials if t.micro_batch_size == lo)
    above = next(t for t in state.trials if t.micro_batch_size == hi)
    if above.outcome != "over_budget" or above.peak_bytes <= below.peak_bytes:
        return None
    return predict_max_micro_batch([(lo, below.peak_bytes), (hi, above.peak_bytes)], s.limit, s.cap)


def worth_trying(s: Ledger, state: RungState, micro: int) -> bool:
    """Whether a trial at `micro` could beat the best measured so far by more than noise.

    The rung's own time model (micro-step time ~ a + b x m, b >= 0, every micro-step charged as a full
    one, as trials are scored) is anchored at the rung's largest fitting trial. A larger micro-batch only
    raises the peak, and a plan within noise of the best is as good as the best: a trial predicted to gain
    less than that cannot improve the plan. One timed size gives no model: then it is worth a try.
    Asked only between or just past measured sizes (bisection, growth): a line through two nearby
    points extrapolated far is not a bound (such a line can rule out a configuration that wins at a
    micro-batch well inside the range).
    """
    best = best_so_far(s)
    anchor = max(state.ok, key=lambda t: t.micro_batch_size, default=None)
    timed = [(t.micro_batch_size, t.step_seconds) for t in state.trials if t.step_seconds > 0]
    if best is None or anchor is None or len({m for m, _ in timed}) < 2:
        return True
    a, b = fit_line(timed)
    b = max(b, 0.0)
    opt = min(t.optimizer_seconds for t in state.ok)

    def seconds(m: int) -> float:  # one global step at micro-batch m, by the model
        return global_step_seconds(max(a + b * m, 1e-9), opt, s.per_rank, m)

    predicted = anchor.samples_per_second * seconds(anchor.micro_batch_size) / seconds(micro)
    if predicted > best.samples_per_second * (1 + NOISE):
        return True
    s.notes.append(f"{state.rung.name}: skipped micro-batch {micro}, predicted {predicted:,.1f} samples/s, "
                   f"within noise of the {best.samples_per_second:,.1f} measured")
    return False
