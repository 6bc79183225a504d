"""Budgets that stay put between calls, and whether a plan still fits in the memory usable now.

`fit` without `memory_budget` takes what the device can give this process (`default_budget`). That figure
moves by megabytes from one call to the next (another process's CUDA context, the host's page cache), and
the budget is part of the cache key: taken as read, no second `fit` would ever hit. So a default budget is
rounded down to a step of 1/64 of the device's memory (1.25 GiB of an 80 GiB GPU, 2 GiB of 128 GiB of
host memory). Rounding down never promises memory that is not free; a plan cached under a step nearby is
served too, when its peak still fits under today's figure less the margin (`fits`), so a reading that
wobbles across step boundaries still hits.

A plan served from the cache, or applied to a model, is checked against the memory usable now
(`shortfall`): another job may have arrived on the GPU since the plan was tuned.
"""

from __future__ import annotations

import torch

from ..sizes import format_bytes
from . import placement as devices
from .placement import Placement

BUDGET_STEPS = 64  # a default budget is a whole number of 1/64ths of the device's memory
MIN_STEP_BYTES = 2**20
# A plan tuned under a default budget up to 6 steps (about 9%) away serves, when its peak fits today. Free
# host memory on a shared machine moved by 2 steps (0.7 of 23.5 GiB) between two fits a few seconds apart.
NEIGHBOUR_STEPS = 6


def budget_step(total_bytes: int) -> int:
    """The rounding step of a default budget on a device of `total_bytes`."""
    return max(MIN_STEP_BYTES, total_bytes // BUDGET_STEPS)


def stable_budget(free_bytes: int, total_bytes: int) -> int:
    """`free_bytes` rounded down to a whole step (kept as is when under one step: nothing to round to)."""
    step = budget_step(total_bytes)
    return free_bytes if free_bytes < step else free_bytes // step * step


def neighbour_budgets(budget: int, total_bytes: int) -> list[int]:
    """The budgets whose cached plans may serve a default budget of `budget`: its own, then the whole steps
    within `NEIGHBOUR_STEPS` of it, nearest first (the larger of two as near)."""
    step = budget_step(total_bytes)
    base = budget // step
    steps = {m * step for m in range(base - NEIGHBOUR_STEPS, base + NEIGHBOUR_STEPS + 1) if m >= 1}
    return [budget, *sorted(steps - {budget}, key=lambda b: (abs(b - budget), -b))]


def fits(peak_bytes: int, margin: float, budget_bytes: int) -> bool:
    """Whether a plan's peak stays under `budget_bytes` less the margin, the rule every trial was held to."""
    return peak_bytes <= (1 - margin) * budget_bytes


def usable_bytes(placement: Placement) -> int:
    """Memory this process could hold on the device now: its default budget plus what it already holds
    (the model and optimizer state, counted in a plan's peak too)."""
    free, _ = devices.default_budget(placement)
    if placement.simulated:
        return free
    return free + torch.cuda.memory_allocated(placement.index)


def shortfall(peak_bytes: int, placement: Placement, what: str) -> str | None:
    """None when `peak_bytes` fits in the memory usable now; else a sentence with the figures and the fix."""
    usable = usable_bytes(placement)
    if peak_bytes <= usable:
        return None
    return (f"{what} peaks at {format_bytes(peak_bytes)} but only {format_bytes(usable)} is usable on "
            f"{placement.name} now (another process may have taken memory since it was tuned). Training will "
            "recover from an out-of-memory error at a smaller micro-batch; to plan for today's memory instead, "
            "free the memory or call fit again with retune=True or a smaller memory_budget.")
