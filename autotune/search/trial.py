"""One trial: put a rung on the model, run a few real optimizer steps at one micro-batch size, measure, and
clean up whatever happened.

In order: apply the rung; run `warmup` + `measured` full optimizer steps (the
optimizer state appears at the first step, so the peak and the timings come from the later ones); time
forward+backward and the optimizer step separately with the device synchronised; read the peak. On an
OOM, the handler only records it: clean-up happens after the `except` block has been left (a held
exception keeps the failed step's tensors alive, pytorch #27600), and the step's locals live in a frame
of their own that dies with the traceback.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from .. import parallel as distributed
from ..configuration import Rung, state_sharded
from ..devices.host import ResidentPeak
from ..devices.placement import MemoryMeter, Placement, now, release_memory
from ..errors import AutotuneError, DeviceError, TooFewSamples, is_device_poisoned, is_oom, needs_more_samples
from ..evidence import NOISY, Trial
from ..settings import DEFAULT_MEASURED_STEPS
from ..sizes import format_bytes, format_share, shorten
from ..techniques import AppliedRung, BlockGroup, apply_rung
from ..techniques.offload import host_buffers, offload_of
from ..techniques.sharding import reset_after_failure
from ..workload import batch as batches
from ..workload.accumulation import LossWeights, weighted_loss
from ..workload.batching import global_step_seconds
from ..workload.loss_choice import label_counts
from ..workload.losses import LossFn, LossForm
from ..workload.optimizers import OptimizerSpec
from . import kept_rung
from .failures import FAILED, Failures, LossCheck, NonFiniteLoss, kept
from .reduced_steps import ReduceGate, abba, reduced_step, reduced_steps
from .tune_time import Laps, merged

log = logging.getLogger(__name__)

# Whole-step times whose (max - min) / median is over this are noisy: steady CPU or GPU steps differ by a
# few percent, while a step that lost its core to another process takes 2-10x as long.
NOISY_SPREAD = 0.5
OVERLAPPED = "overlapped optimizer offload"  # the note of a trial whose measured steps overlapped it
REDUCE_BOTH_WAYS = "gradient all-reduce timed in buckets during backward and in one after it"  # its trial's note
MAX_STEPS_FACTOR = 3  # a noisy CPU trial runs up to this many times its measured steps
# Two measured steps this close are steady: a third would move their median by less than the search's noise
# (3%), so the trial stops there. A GPU's steps at one shape differ by well under 1%.
STEADY_SPREAD = 0.02


@dataclass(kw_only=True, slots=True)
class Workload:
    """Everything a trial needs that does not change between trials.

    Large: a record, one field per input every trial reads (the model, its example and loss, the optimizer's
    recipe, the budgets and how many steps to measure); no behaviour to split off.
    """

    model: nn.Module
    batch: Any  # the example batch, already on the device
    loss_fn: LossFn
    spec: OptimizerSpec
    placement: Placement
    budget_bytes: int
    limit_bytes: int  # (1 - margin) x budget: a plan's peak must stay below this
    per_rank: int
    world_size: int = 1
    blocks: BlockGroup | None = None
    warmup_steps: int = 1
    measured_steps: int = 3
    host_limit_bytes: int | None = None  # the host budget (fit refuses configurations over it before they run)
    snapshot_in_ram: bool = True  # fit's copy of the model is in host memory (not in a file: `snapshot_on_disk`)
    loss_form: LossForm | None = None  # what the model's own loss holds, learned by the trials; None: not yet
    # Puts the model's weights and buffers back as fit found them: after a trial whose NaN or infinite loss
    # stepped them to NaN, so the next trial starts from finite ones. None: not possible (a sharded copy).
    reset: Callable[[], None] | None = None
    # The token length the plan's peak is measured at (`max_length`), past which attention is never padded; None:
    # the example's own. The trial at the example's typical length keeps the search's, as training does.
    longest: int | None = None

    def longest_tokens(self) -> int | None:
        """`longest`, or the example's token length (None for a batch of no tokens)."""
        return self.longest if self.longest is not None else batches.tokens_per_sample(self.batch)


def agree_local(trial: Trial) -> Trial:
    """Single process: nothing to agree with. Under torch.distributed: `distributed.agree_trial`."""
    return trial


class TrialRunner:
    """Callable `(rung, micro_batch_size) -> Trial`; what the controller calls for every measurement.

    A trial that runs out of memory, raises another error (not autotune's own) or computes a NaN or infinite
    loss is returned as such (outcome "oom", "error", "non_finite"), its reason in its note and, for the last
    two, in `failures`: the search goes on without the configuration.
    """

    def __init__(self, work: Workload, agree: Callable[[Trial], Trial] = agree_local,
                 failures: Failures | None = None) -> None:
        self.work = work
        self.agree = agree
        self.failures = failures if failures is not None else Failures()

    def __call__(self, rung: Rung, micro: int, *, measured_steps: int | None = None,
                 offload_fraction: float = 1.0, overlap: bool = False, reduce_pairs: int = 0,
                 sharding: str = "none") -> Trial:
        """A trial of `rung` at micro-batch `micro`. `measured_steps` overrides the workload's; under optimizer
        offload, `offload_fraction` is the host's share and `overlap` steps the host during the measured steps'
        backward; replicated on several ranks, `reduce_pairs` times the all-reduced step that many times each
        way, in buckets and in one after backward (`ReduceGate`), and `sharding` "optimizer_state" partitions the
        optimizer state over them (as the plan names it)."""
        work = self.work
        laps = Laps("set-up")  # every second of the trial, in its phases (`Trial.phases`)
        key = (rung, offload_fraction, bool(overlap), sharding)
        if kept_rung.holds_other(key):
            laps.enter("restore")  # the rung an earlier trial left, undone before this trial measures anything
            kept_rung.release()
            laps.enter("set-up")
        # Training may hold this rank's whole batch on the device (the caller put it there) while its micro-batches
        # run: the trial holds one of that size too, its micro-batch a view of it, so every peak counts it. The
        # micro-batch is its first samples, a padded one among them where any is (`padded_first`).
        held = batches.padded_first(batches.resize(work.batch, work.per_rank))
        micro_batch = batches.take(held, 0, micro)
        meter = MemoryMeter(work.placement, work.budget_bytes)
        host = ResidentPeak()  # the host memory the configuration adds: offload's buffers, pinned copies
        timings: tuple[float, float, float, float, float, str] | None = None
        failure, failed_as = "", "oom"
        error: BaseException | None = None  # an error other than an OOM, kept to raise again if all fail
        poisoned = False
        gate = ReduceGate(work.model)
        reused = 0  # host bytes the trial was lent from the tune's pool (`host_buffers`): its rise does not show them
        # The previous trial's rung, where only the micro-batch changed; its engine's device tensors count here
        applied, kept_bytes = kept_rung.take(key)
        resident = kept_rung.resident(applied) if applied is not None else []
        keep = False
        try:
            try:
                with meter.watching(work.model, held, resident), distributed.armed():  # a trial may run out of memory
                    if applied is None:
                        applied = apply_rung(work.model, rung, work.spec, work.placement, work.blocks,
                                             offload_fraction=offload_fraction, overlap=True if overlap else None,
                                             sharding=sharding, longest=work.longest_tokens())
                    laps.enter("warm-up")
                    laps.move("set-up", "host buffers", applied.host_buffer_seconds)
                    timings = _run_steps(applied, micro_batch, work, measured_steps or work.measured_steps, overlap,
                                         gate, reduce_pairs, laps)
            except Exception as exc:  # classified right here: autotune's own errors and a poisoned context raise
                if is_device_poisoned(exc):
                    poisoned = True  # clean-up must make no CUDA call: it would fail too and hide this error
                    raise DeviceError(f"CUDA error during a trial of {rung.name} at micro-batch {micro}: {exc}. "
                                      "The CUDA context is unusable; restart the process.") from exc
                if micro == 1 and needs_more_samples(exc):
                    raise TooFewSamples(_first_line(exc)) from exc  # the search starts again at 2
                if isinstance(exc, AutotuneError):  # a setting autotune refuses: no configuration would do better
                    raise
                # Any other error fails this configuration alone (a kernel this device lacks in bf16, compile's
                # tracing): the search goes on without it, and fit raises only where every configuration failed.
                failure = str(exc) if isinstance(exc, NonFiniteLoss) else _first_line(exc)
                failed_as = "oom" if is_oom(exc) else "non_finite" if isinstance(exc, NonFiniteLoss) else "error"
                error = kept(exc) if failed_as == "error" else None
                gate.fail()  # ranks still measuring learn of it where they would start the all-reduce
            # Out of the except block: the exception no longer pins the failed step's tensors. Read the
            # peak now, before clean-up resets the allocator's statistics.
            reading = meter.read()
            keep = timings is not None and applied is not None and kept_rung.keeps(applied, work.placement)
        finally:
            reused = _clean_up(work, applied, laps, device_calls=not poisoned, keep=key if keep else None)
        reused += kept_bytes  # the host bytes a kept rung holds: lent by an earlier trial, held since
        del micro_batch, held, resident
        trial = _make_trial(rung, micro, work, reading.peak_bytes, reading.alloc_retries, timings, failure, failed_as)
        trial = dataclasses.replace(trial, host_peak_bytes=host.grown() + reused, sharding=sharding)
        tags = ([state_sharded()] if sharding == "optimizer_state" else
                [] if offload_fraction >= 1.0 or rung.offload != "optimizer" else
                [f"offload fraction {format_share(offload_fraction)}"])
        tags += [OVERLAPPED] if overlap else []
        phases = laps.close()  # the trial's end: what follows is the ranks agreeing, and a reset
        trial = dataclasses.replace(trial, overlapped=bool(overlap), seconds=sum(phases.values()), phases=phases)
        tags += [REDUCE_BOTH_WAYS] if reduce_pairs and gate.opened and trial.fits else []
        if tags:
            trial = dataclasses.replace(trial, note="; ".join([*tags, trial.note] if trial.note else tags))
        trial = self.agree(trial)
        if trial.outcome in FAILED:  # here or, agreed, on another rank (its note says so)
            self.failures.record(trial, failure if trial.outcome == failed_as else trial.note, error)
        if trial.outcome == "non_finite" and work.reset is not None:
            reset = Laps("restore")  # the weights a NaN loss stepped put back: this rank's restore, counted in
            work.reset()  # after the ranks agreed on the rest
            trial = dataclasses.replace(trial, seconds=trial.seconds + sum(reset.close().values()),
                                        phases=merged([trial.phases, reset.phases]))
        return trial


def _run_steps(applied: AppliedRung, micro_batch: Any, work: Workload, measured: int, overlap: bool = False,
               gate: ReduceGate | None = None, reduce_pairs: int = 0,
               laps: Laps | None = None) -> tuple[float, float, float, float, float, str]:
    """Median (forward+backward seconds, optimizer seconds) over the measured steps, the warm-up steps' time
    beyond them (compile time, on a compiled configuration), the all-reduce's cost in buckets (`ReduceGate`;
    in the optimizer seconds too) and in one after backward (with `reduce_pairs`, else 0), and a note when the
    timings stayed noisy.

    Under optimizer offload a trial's one micro-batch is also the last, whose backward the host optimizer
    may overlap; in training only the last of k is. The warm-up steps overlap (their peak, which the meter
    sees, is the last backward's), the measured ones do not unless `overlap`: the search's k x step +
    optimizer is then what training does for k - 1 of them. Measured with every step overlapped, the host
    optimizer's threads slowed a launch-bound compiled backward and the estimate fell under the trained
    rate (benchmarks/bench_trial_accuracy.py), which ranked compiled configurations too low.

    On the CPU, timings whose spread is wide (another process competing for the cores: on a busy 2-core
    machine micro-batch 1 once "measured" 15x micro-batch 2) earn more measured steps, up to
    `MAX_STEPS_FACTOR` times as many, so the median rests on more than two or three readings.

    `laps` (the trial's phases) is in its warm-up when called; it leaves the warm-up's compiling (compiled
    configurations only) to "compile", and is in "measured" from the first measured step on.
    """
    laps = laps if laps is not None else Laps()
    work.model.train()
    counts = label_counts(work.model, micro_batch)
    tokens = None if counts is None else float(counts.sum())
    if work.loss_form is None:
        work.loss_form = LossForm.of(work.model)
    form = work.loss_form
    losses = LossCheck()  # a NaN or infinite loss fails the trial: such a configuration is never the plan
    step = lambda armed: _timed_step(applied, micro_batch, work, tokens, form, armed, losses)  # noqa: E731
    warmup = sum(sum(step(True)) for _ in range(work.warmup_steps))
    losses.check("the warm-up steps")  # read here, not in a timed step: reading a loss waits for the device
    laps.enter("measured")
    times = steady_steps(lambda: step(overlap), measured, early=measured == DEFAULT_MEASURED_STEPS)
    # Not under torch.distributed: each rank would judge its own spread and run its own number of steps (a
    # sharded model's steps are collectives); the ranks' MAX of the step time is the agreed figure there.
    while (work.placement.simulated and not distributed.active() and spread(times) > NOISY_SPREAD
           and len(times) < MAX_STEPS_FACTOR * measured):
        times.append(step(overlap))
    losses.check("the measured steps")
    step_s, opt_s = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
    noisy = spread(times) > NOISY_SPREAD
    note = f"{NOISY} (step times spread {spread(times):.0%} over {len(times)} steps)" if noisy else ""
    compile_s = max(0.0, warmup - work.warmup_steps * (step_s + opt_s))
    if applied.rung.compile:
        laps.move("warm-up", "compile", compile_s)
    reduce_s = after_s = 0.0
    if gate is not None and gate.open():
        forward = lambda weights: _loss(applied, micro_batch, work, weights, tokens, form)  # noqa: E731
        samples = batches.batch_size(micro_batch)
        reduced = lambda overlap: reduced_step(applied, work.model, work.placement, forward,  # noqa: E731
                                               samples=samples, tokens=tokens, overlap=overlap)
        order = abba(reduce_pairs) if reduce_pairs else [True] * max(1, measured // work.measured_steps)
        bucketed, after = reduced_steps(reduced, order)
        reduce_s = max(0.0, statistics.median(bucketed) - step_s)
        after_s = max(0.0, statistics.median(after) - step_s) if after else 0.0
    return step_s, opt_s + reduce_s, compile_s, reduce_s, after_s, note


def steady_steps(step: Callable[[], tuple[float, float]], count: int, *, early: bool) -> list[tuple[float, float]]:
    """`count` timed steps, or two once those are steady (`STEADY_SPREAD`) where `early` allows: at the default
    count (a count the user set, or the runoff's longer run, is run in full).

    Not early under torch.distributed: each rank would judge its own two steps, and ranks that stopped at
    different counts would wait on each other's collectives.
    """
    times = [step() for _ in range(min(count, 2))]
    if early and not distributed.active() and spread(times) <= STEADY_SPREAD:
        return times
    times.extend(step() for _ in range(count - len(times)))
    return times


def _timed_step(applied: AppliedRung, micro_batch: Any, work: Workload, tokens: float | None,
                form: LossForm, armed: bool, losses: LossCheck | None = None) -> tuple[float, float]:
    """One optimizer step at one micro-batch: (forward+backward seconds, optimizer seconds); its loss goes to
    `losses`, read after the steps."""
    t0 = now(work.placement)
    size = batches.batch_size(micro_batch)
    weights = LossWeights(size, 1, total=tokens)
    if size < work.per_rank:  # training accumulates: hold what its later micro-steps hold
        weights.carry_totals(work.placement.torch_device)
    loss = _loss(applied, micro_batch, work, weights, tokens, form)
    if losses is not None:
        losses.add(loss)
    if loss is not None:
        applied.backward(loss, last=armed)  # armed: the host optimizer steps during it (see `_run_steps`)
    del loss, weights
    t1 = now(work.placement)
    applied.optimizer_step()
    applied.zero_grad()
    return t1 - t0, now(work.placement) - t1


def _loss(applied: AppliedRung, micro_batch: Any, work: Workload, weights: LossWeights, tokens: float | None,
          form: LossForm) -> Any:
    """The forward: the same loss the training step computes (num_items_in_batch included), one micro-batch
    a step."""
    with applied.autocast():
        return weighted_loss(work.loss_fn, work.model, applied.inputs(micro_batch), weights,
                             batches.batch_size(micro_batch), expected=tokens, form=form)


def spread(times: list[tuple[float, float]]) -> float:
    """(slowest - fastest) / median of whole steps: 0 for steady timings, 1 when one step took twice another."""
    totals = sorted(a + b for a, b in times)
    if len(totals) < 2 or totals[len(totals) // 2] <= 0:
        return 0.0
    return (totals[-1] - totals[0]) / statistics.median(totals)


def noise_note(trials: list[Trial]) -> str:
    """A clause for the plan's reason when some fitting trials' timings stayed noisy, else ""."""
    noisy = [t for t in trials if t.fits and t.noisy]
    if not noisy:
        return ""
    return (f"timings were noisy in {len(noisy)} of {sum(t.fits for t in trials)} trials (another process "
            "competing for the CPU?), so the pick between close configurations may not hold")


def _clean_up(work: Workload, applied: AppliedRung | None, laps: Laps | None = None, *,
              device_calls: bool = True, keep: kept_rung.Key | None = None) -> int:
    """Undo the rung and give every byte of the trial back before the next one measures its peak; the host
    buffers it was lent go back to the tune's pool for the next trial (the bytes lent again are returned).
    With `keep`, optimizer offload's rung stays on the model instead, for the next trial of that key
    (`kept_rung`): its state dropped, no weight restored.

    The trial's optimizer (and its state: 8 bytes a parameter for AdamW) must be dropped before
    `empty_cache()`: freed later, its blocks would stay cached and count in the next trial's reserved peak.
    After a poisoned context (`device_calls=False`) no CUDA call is made; a context found poisoned here
    (an asynchronous error surfacing at the synchronize) is a `DeviceError`, like one in the trial.

    Raises:
        DeviceError: the synchronize or `empty_cache()` reported a poisoned context.
    """
    laps = laps if laps is not None else Laps()
    laps.enter("restore")  # the weights back as they were: FP32 copies, shards, the host optimizer's masters
    reset_after_failure(work.model)  # FSDP2: a step that failed left blocks unsharded
    if applied is not None and keep is not None:
        reused = kept_rung.keep(keep, applied, work.placement)  # its buffers stay lent, to the next trial
    else:
        if applied is not None:
            offload_of(applied.optimizer).discard_state()  # its moments go before the FP32 weights come back
            applied.remove()
            applied.optimizer = None
            applied.scaler = None
        reused = host_buffers.reclaim()  # nothing holds them now: the next trial may be lent them
    laps.enter("clean-up")
    for p in work.model.parameters():
        p.grad = None
    gc.collect()
    if not device_calls:
        return reused
    try:
        release_memory(work.placement, reset_peak=True)
    except Exception as exc:  # classified here; anything else propagates untouched
        if is_device_poisoned(exc):
            raise DeviceError(f"CUDA error while cleaning up after a trial: {exc}. The CUDA context is unusable; "
                              "restart the process.") from exc
        raise
    return reused


def _make_trial(rung: Rung, micro: int, work: Workload, peak: int, retries: int,
                timings: tuple[float, float, float, float, float, str] | None, failure: str,
                failed_as: str = "oom") -> Trial:
    """The trial's record; its `seconds` and `phases` are set once it has cleaned up."""
    if timings is None:  # the trial failed: `failed_as` says how
        return Trial(rung=rung, micro_batch_size=micro, outcome=failed_as, peak_bytes=peak,
                     alloc_retries=retries, note=shorten(failure, 200))
    step_s, opt_s, compile_s, reduce_s, after_s, noisy = timings
    rate = _rate(step_s, opt_s, work.per_rank, work.world_size, micro)
    outcome = "ok" if peak <= work.limit_bytes else "over_budget"
    note = noisy if outcome == "ok" else (f"peak {format_bytes(peak)} is above the {format_bytes(work.limit_bytes)} "
                                          "limit (budget less margin)")
    return Trial(rung=rung, micro_batch_size=micro, outcome=outcome, peak_bytes=peak,
                 step_seconds=step_s, optimizer_seconds=opt_s, samples_per_second=rate,
                 alloc_retries=retries, compile_seconds=compile_s if rung.compile else 0.0, reduce_seconds=reduce_s,
                 reduce_after_seconds=after_s, noisy=outcome == "ok" and bool(noisy), note=note)


def retimed(trial: Trial, optimizer_seconds: float, per_rank: int, world: int, **changes: Any) -> Trial:
    """`trial` with its once-a-step cost set to `optimizer_seconds` (and any `changes`), its rate estimated
    again: for a choice made after the trial (how the optimizer or the all-reduce meets the last backward)
    that measured the once-a-step part shorter."""
    rate = _rate(trial.step_seconds, optimizer_seconds, per_rank, world, trial.micro_batch_size)
    return dataclasses.replace(trial, optimizer_seconds=optimizer_seconds, **changes, samples_per_second=rate)


def _rate(step_s: float, optimizer_s: float, per_rank: int, world: int, micro: int) -> float:
    """Samples a second over all ranks, from one micro-step's and the once-a-step part's seconds."""
    per_step = global_step_seconds(step_s, optimizer_s, per_rank, micro)
    return per_rank * world / per_step if per_step > 0 else 0.0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
