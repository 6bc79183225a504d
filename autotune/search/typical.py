"""A plan's rate at the example's own length, where `fit` ran the trials at `max_length`.

The trials run every configuration at the longest sequence training will see, so that no length passes the
plan's peak. The rate at that length understates training on shorter batches: attention's cost per token grows
with the length. When `fit` lengthened the example to `max_length`, one more trial runs the chosen
configuration at the example's own length, the length the user gave as typical, and the plan's samples/s,
tokens/s, FLOPs per sample and MFU are that trial's; its peak and `max_length` stay the longest length's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .. import parallel as distributed
from ..workload import batch as batches
from . import kept_rung
from .flops import FlopCount, count_flops
from .ledger import Ledger
from .offload_overlap import as_trained
from .progress import Runner
from .trial import TrialRunner, Workload


@dataclasses.dataclass(frozen=True, slots=True)
class TypicalRate:
    """The chosen configuration measured at the example's own length."""

    length: int  # tokens per sample
    samples_per_second: float
    flops: FlopCount


def measure(state: Ledger, work: Workload, example: Any,
            watch: Callable[[Runner, str], Runner] | None = None) -> tuple[TypicalRate | None, str]:
    """The pick's rate (`state.picked()`) on `example` (on the host; moved to the device here) from one trial, or
    two (`offload_overlap.as_trained`), and the note for the plan's reason; no rate when the trial did not run
    clean (the rate at `max_length` then stands). `watch` shows the trials as the search's progress lines do."""
    batch = batches.detached(batches.to_device(example, work.placement.torch_device))
    length = batches.tokens_per_sample(batch) or 0
    best = state.picked()
    # The search's own host share, and its sharding of the optimizer state
    fraction = state.fraction if best.rung.offload == "optimizer" and state.fraction is not None else 1.0
    at_example = dataclasses.replace(work, batch=batch, longest=work.longest_tokens())  # padded as training pads
    run: Runner = TrialRunner(at_example, agree=distributed.agree_trial)
    if watch is not None:
        run = watch(run, f"at the example's length ({length} tokens)")
    # Twice the measured steps, as the search re-measures a close call: this trial stands for the plan's rate
    trial = as_trained(lambda overlap: run(best.rung, best.micro_batch_size, offload_fraction=fraction,
                                           overlap=overlap, measured_steps=2 * work.measured_steps,
                                           sharding=best.sharding),
                       state.overlap is True, best.micro_batch_size, work.per_rank)
    if not trial.fits or not trial.samples_per_second:
        why = f"{trial.outcome}: {trial.note}" if trial.note else trial.outcome
        return None, (f"rate at the example's length ({length} tokens) not measured ({why}): the figures "
                      "are at max_length")
    # The count runs the model as `fit` found it: the trial may have left optimizer offload's rung on it, whose
    # 16-bit weights a forward without the trial's autocast cannot run.
    kept_rung.release()
    flops = count_flops(work.model, batch, work.loss_fn, work.placement)
    note = (f"figures at the example's length, {length} tokens ({trial.samples_per_second * length:,.0f} tokens/s; "
            f"{best.samples_per_second * (batches.tokens_per_sample(work.batch) or 0):,.0f} at max_length, where the "
            f"peak was measured)")
    return TypicalRate(length, trial.samples_per_second, flops), note
