"""Python's garbage collector on several ranks: collect at the same step on every rank, never inside a step.

A data-parallel step is as slow as its slowest rank. Python's cyclic collector runs whenever allocations
cross its thresholds, at a moment of its own on each rank, and a full collection in a process holding
torch, a model and its compiled graphs pauses that rank for milliseconds to tens of them while the other
ranks wait for it in the next collective: every rank's pauses end up in every rank's step. So under
torch.distributed automatic collection is off *inside* each step of a `TrainingStep`, and every `EVERY`
steps each rank collects everything at the start of the step, the same step on every rank (the step
count is the same everywhere), where the pauses overlap instead of adding up. That full collection also
resets the collector's counts, so the collections Python still runs on its own between steps (in the
user's loop) are the cheap young-generation ones. torchtitan, torchtnt and LLM Foundry schedule their
trainers' collections the same way; they turn automatic collection off for the whole run, which a library
cannot do to its user's process: here it is back on as soon as each step returns, whatever happens.

One process is left alone: a pause costs only itself there. `AUTOTUNE_GC=auto` leaves Python's automatic
collection on under torch.distributed too.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

from ..errors import InvalidSetting
from . import distributed

EVERY = 50  # steps between collections: the collection's cost spread thin, cyclic garbage short-lived
ENV = "AUTOTUNE_GC"
MODES = ("scheduled", "auto")


def mode() -> str:
    """`AUTOTUNE_GC`: "scheduled" (the default) or "auto"."""
    value = os.environ.get(ENV, "scheduled").strip().lower() or "scheduled"
    if value not in MODES:
        raise InvalidSetting(f"{ENV}={value!r}: use 'scheduled' (under torch.distributed, collect every {EVERY} "
                             "steps at the same step on every rank, none inside a step; the default) or 'auto' "
                             "(Python's automatic collection)")
    return value


class StepCollector:
    """One `TrainingStep`'s schedule: wrap each step in `during_step()`."""

    def __init__(self) -> None:
        self.active = distributed.world_size() > 1 and mode() == "scheduled"
        self.steps = 0
        self.collections = 0

    @contextlib.contextmanager
    def during_step(self) -> Iterator[None]:
        if not self.active or not gc.isenabled():  # off already: the process manages its own collections
            yield
            return
        if self.steps and self.steps % EVERY == 0:
            gc.collect()
            self.collections += 1
        self.steps += 1
        gc.disable()
        try:
            yield
        finally:
            gc.enable()
