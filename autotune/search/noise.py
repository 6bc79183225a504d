"""Timings in doubt, and measuring them again before they decide anything.

On the CPU another process can take the cores in the middle of a trial: its steps then take 2-10x as long, and
one such reading, believed, ends micro-batch growth (the time line through it says a larger micro-batch cannot
pay) or loses the pick to a configuration that happened to run on a quiet core. A trial's timing is in doubt
when its own step times spread wide (`Trial.noisy`), or when it is slower than the same configuration's other
micro-batches allow (`slowed`: contention holds a whole trial just as well as one step of it). Such a trial is
measured again, a bounded number of times (`settle`), and the reading kept takes its place in the record.

Another process can only slow a step, never speed it up: where every reading stays in doubt the fastest is
kept. A steady reading is kept as it is, so a configuration measured three times gains no edge over one
measured once when both ran undisturbed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from ..evidence import Trial
from .tune_time import merged

RETRIES = 2  # readings more, at most, of a trial whose timing is in doubt
# One micro-batch's time per sample over this times a smaller one's, on the same configuration, or its whole
# micro-step over this times a larger one's: more than batching explains (a larger micro-batch amortises fixed
# costs, so its time per sample falls or holds; a smaller one does less work), so the slower reading lost its
# core. Only used where the trials run on the CPU (`Ledger.retry`).
SLOWER = 1.5


def slowed(trial: Trial, other: Trial) -> bool:
    """Whether `trial` took longer than `other`, the same configuration at another micro-batch, can explain."""
    m, o = trial.micro_batch_size, other.micro_batch_size
    if m == o or trial.step_seconds <= 0 or other.step_seconds <= 0:
        return False
    if o < m:
        return trial.step_seconds / m > SLOWER * other.step_seconds / o
    return trial.step_seconds > SLOWER * other.step_seconds


def doubtful(trial: Trial, siblings: Sequence[Trial] = ()) -> bool:
    """Whether a fitting `trial`'s timing is in doubt: noisy steps, or slowed beside one of `siblings` (fitting
    trials of its configuration at other micro-batches)."""
    return trial.fits and (trial.noisy or any(s.fits and slowed(trial, s) for s in siblings))


def settle(first: Trial, again: Callable[[], Trial], siblings: Sequence[Trial] = (),
           retries: int = RETRIES) -> Trial:
    """`first`, in doubt, measured again up to `retries` times; the first reading no longer in doubt is kept
    (or the first that did not fit: a memory verdict stands), else the fastest. Its note gives every reading's
    rate, and its `seconds` and `phases` all of them."""
    readings = [first]
    for _ in range(retries):
        reading = again()
        readings.append(reading)
        if not doubtful(reading, siblings):
            break
    last = readings[-1]
    kept = last if not doubtful(last, siblings) else max(readings, key=lambda t: t.samples_per_second)
    rates = ", ".join(f"{t.samples_per_second:,.1f}" for t in readings if t.fits)
    note = f"timings in doubt, measured {len(readings)} times ({rates} samples/s)"
    return timed_with(kept, readings, note)


def timed_with(kept: Trial, readings: Sequence[Trial], note: str) -> Trial:
    """`kept`, one of `readings` of one configuration, in their place in the record: its `seconds` and `phases`
    all of theirs (a first reading's compile included, so the tune's account keeps every second), `note` added."""
    return dataclasses.replace(kept, seconds=sum(t.seconds for t in readings),
                               phases=merged([t.phases for t in readings]),
                               note=f"{kept.note}; {note}" if kept.note else note)
