"""One trial of one configuration, as every step runs it: the micro-batch snapped to the allowed sizes and the
floor, a size already measured never run again, a reading in doubt measured again (`noise.py`), micro-batch 1
given up for good when batch statistics refuse it, and the trial budget."""

from __future__ import annotations

import functools
import logging

from ..errors import InvalidSetting, TooFewSamples
from ..evidence import Trial
from ..sizes import format_bytes
from ..workload.batching import smallest_micro_batch
from .ledger import Ledger, RungState
from .lines import snap
from .noise import doubtful, settle

log = logging.getLogger("autotune.search.controller")


def measure(s: Ledger, state: RungState, micro: int) -> Trial:
    """The trial of `state`'s rung at `micro` (snapped to an allowed size, not below the floor): the one measured
    already, else a new one, recorded in `state` and in the ledger, its timing settled if in doubt."""
    micro = max(snap(s, micro), s.floor)
    for t in state.trials:
        if t.micro_batch_size == micro:
            return t
    try:
        trial = s.runner(state.rung, micro)
    except TooFewSamples as exc:
        raise_floor(s, str(exc))
        return measure(s, state, micro)
    log.debug("trial %-32s micro-batch %4d: %-11s peak %10s  %s", state.rung.name, micro, trial.outcome,
              format_bytes(trial.peak_bytes),
              f"{trial.samples_per_second:,.1f} samples/s" if trial.fits else trial.note)
    state.trials.append(trial)
    s.trials.append(trial)
    settle_doubts(s, state)
    return next(t for t in state.trials if t.micro_batch_size == micro)


def settle_doubts(s: Ledger, state: RungState) -> None:
    """Measure again each of the rung's trials whose timing is in doubt (`noise.doubtful`: noisy, or slower
    than its siblings allow), once each, before it can end growth or decide the pick; the reading kept
    (`noise.settle`) takes the first one's place. Without `retry` (on a GPU) readings stand as measured."""
    if s.retry is None:
        return
    retry = s.retry
    for first in list(state.trials):
        siblings = [t for t in state.ok if t is not first]
        key = (first.rung, first.micro_batch_size)
        if key in s.settled or not doubtful(first, siblings):
            continue
        s.settled.add(key)
        kept = settle(first, functools.partial(retry, first.rung, first.micro_batch_size), siblings)
        log.debug("re-measured %-26s micro-batch %4d: %s", first.rung.name, first.micro_batch_size, kept.note)
        state.trials[state.trials.index(first)] = kept
        s.trials[s.trials.index(first)] = kept


def raise_floor(s: Ledger, failure: str) -> None:
    """Micro-batch 1 failed on batch statistics (BatchNorm over one value per channel): no micro-batch
    of the plan may hold fewer than 2 samples, so the search starts at the smallest size whose split
    of the per-rank batch keeps every micro-batch at 2 or more (3 for an odd batch)."""
    floor = smallest_micro_batch(s.per_rank, 2)
    if floor is None:
        raise InvalidSetting(f"the model cannot train on a micro-batch of 1 sample ({failure}: batch statistics "
                             f"such as BatchNorm need at least 2), and the per-rank batch is {s.per_rank}; "
                             "raise global_batch_size to 2 or more samples per rank") from None
    s.smallest, s.floor = 2, floor
    s.floor_note = (f"micro-batch 1 skipped: {failure} (batch statistics), so every micro-batch holds "
                    f"2 samples or more and the split is balanced; the search starts at {s.floor}")
    s.notes.insert(0, s.floor_note)


def budget_left(s: Ledger) -> bool:
    """Whether the trial budget (`max_trials`) allows another trial."""
    return len(s.trials) < s.max_trials
