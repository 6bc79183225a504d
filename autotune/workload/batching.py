"""Pure arithmetic: the accumulation solve, the memory-slope prediction and bisection. No torch here."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..errors import InvalidSetting
from ..sizes import brief

# Samples per optimizer step over all ranks, at most. Each rank's share is one batch in memory, and the
# search walks every micro-batch size up to it, so a number beyond any real training run is a typo.
MAX_GLOBAL_BATCH_SIZE = 2**20


def check_global_batch_size(value: object, setting: str = "global_batch_size") -> int:
    """`value` when it is a positive integer of at most `MAX_GLOBAL_BATCH_SIZE`; else an `InvalidSetting`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidSetting(f"{setting} must be a positive integer, got {brief(value)}")
    if value > MAX_GLOBAL_BATCH_SIZE:
        raise InvalidSetting(
            f"{setting} ({brief(value)}) is too large: at most {MAX_GLOBAL_BATCH_SIZE:,} samples per optimizer step "
            f"over all ranks; pass the samples of one optimizer step (e.g. 64), not of an epoch or a run.")
    return value


def per_rank_batch(global_batch_size: int, world_size: int) -> int:
    """Samples each rank handles per optimizer step; the global batch must divide by the world size."""
    check_global_batch_size(global_batch_size)
    if world_size < 1:
        raise InvalidSetting(f"world_size must be at least 1, got {world_size}")
    if global_batch_size % world_size:
        lower = global_batch_size - global_batch_size % world_size
        upper = lower + world_size
        nearest = f"{lower} or {upper}" if lower > 0 else f"{upper}"
        raise InvalidSetting(
            f"global_batch_size ({global_batch_size}) must be a multiple of the world size ({world_size}) so "
            f"every rank gets the same share; the nearest valid values are {nearest}.")
    return global_batch_size // world_size


def solve_accumulation(per_rank: int, micro_batch_size: int, smallest: int = 1) -> tuple[int, int]:
    """(accumulation_steps, last_micro_batch_size) covering exactly `per_rank` samples.

    The global batch is never changed: when `micro_batch_size` does not divide `per_rank`, the last
    micro-batch is smaller (and the step weights losses by sample count so the gradient is exact). With
    `smallest` > 1 (a model that cannot train on fewer samples) the split is balanced instead whenever
    the plain one would end under it: see `split_sizes`.
    """
    if micro_batch_size < 1 or per_rank < 1:
        raise InvalidSetting(f"micro-batch ({micro_batch_size}) and per-rank batch ({per_rank}) must be positive")
    steps, _, last = split_shape(per_rank, micro_batch_size, smallest)
    return steps, last


def split_shape(n: int, micro_batch_size: int, smallest: int = 1) -> tuple[int, int, int]:
    """(count, first, last) of `split_sizes(n, micro_batch_size, smallest)`, computed without building it.

    The split is some micro-batches of `first` samples then the rest of `last` (`first` >= `last`).
    """
    micro = min(micro_batch_size, n)
    steps = ceil_div(n, micro)
    last = n - (steps - 1) * micro
    if last >= smallest or n < smallest:
        return steps, micro, last
    steps = min(steps, n // smallest)
    small, larger = divmod(n, steps)
    return steps, small + 1 if larger else small, small


def split_sizes(n: int, micro_batch_size: int, smallest: int = 1) -> list[int]:
    """Sizes of the micro-batches that cover `n` samples: all `micro_batch_size` but possibly the last.

    When that last one would hold fewer than `smallest` samples (BatchNorm cannot train on 1), the same
    number of micro-batches is balanced instead (10 at 3: 3+3+2+2, not 3+3+3+1), largest first, none
    above `micro_batch_size`; only where that is impossible (7 at 2) are there fewer, one a sample larger
    (3+2+2). A batch of fewer than `smallest` samples is one micro-batch: nothing can split it better.
    """
    steps, first, last = split_shape(n, micro_batch_size, smallest)
    # k micro-batches of `first` and the rest of `last` sum to n: k = (n - steps x last) / (first - last).
    k = steps - 1 if first == last else (n - steps * last) // (first - last)
    return [first] * k + [last] * (steps - k)


def smallest_micro_batch(per_rank: int, smallest: int) -> int | None:
    """The smallest micro-batch whose split of `per_rank` holds no micro-batch under `smallest` samples and
    none over itself (2 for an even batch, 3 for an odd one, when `smallest` is 2); None if none can."""
    for micro in range(max(1, smallest), per_rank + 1):
        _, first, last = split_shape(per_rank, micro, smallest)
        if last >= smallest and first <= micro:
            return micro
    return None


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) through (x, y) points; needs two distinct x."""
    xs = [p[0] for p in points]
    if len(set(xs)) < 2:
        raise ValueError("need two distinct x values to fit a line")
    n = len(points)
    mx = sum(xs) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    slope = sxy / sxx
    return my - slope * mx, slope


def predict_max_micro_batch(points: Sequence[tuple[int, int]], limit_bytes: float, cap: int) -> int:
    """Largest micro-batch whose predicted peak stays under `limit_bytes`, from `peak(m) = fixed + m x slope`.

    `points` are (micro_batch, peak_bytes) of trials that ran. The answer is clamped to [1, cap]. A flat or
    falling slope is noise (allocator rounding swamps a few samples' activations), not a sign that memory
    is free: then the guess is only double the largest measured size.
    """
    fixed, slope = fit_line([(float(m), float(p)) for m, p in points])
    if slope <= 0:
        return max(1, min(cap, 2 * max(m for m, _ in points)))
    guess = math.floor((limit_bytes - fixed) / slope)
    return max(1, min(cap, guess))


def bisect_next(largest_ok: int, smallest_bad: int) -> int | None:
    """Midpoint to try between a micro-batch that fits and one that does not; None when they are adjacent."""
    if smallest_bad - largest_ok <= 1:
        return None
    return (largest_ok + smallest_bad) // 2


def global_step_seconds(micro_seconds: float, optimizer_seconds: float, per_rank: int, micro: int) -> float:
    """Estimated time of one optimizer step over `per_rank` samples at micro-batch `micro`.

    Every micro-step is charged `micro_seconds`, a smaller last one included: it costs at most that, and
    on a launch-bound GPU nearly that; charged in proportion to its size, uneven splits look faster than
    they train. Then one optimizer step.
    """
    steps, _ = solve_accumulation(per_rank, micro)
    return steps * micro_seconds + optimizer_seconds


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
