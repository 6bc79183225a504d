"""`plan.apply()`: the training step, with exact gradient accumulation and recovery from OOM mid-training.

    step = plan.apply(model, optimizer)
    loss = step(batch)      # one optimizer step over this rank's share of a global batch
    step.plan               # the plan in force (a smaller micro-batch, or a higher rung, after a recovery)
    step = plan.apply(model, optimizer, max_grad_norm=1.0)   # clip the whole batch's gradient norm
    step.last_grad_norm     # the norm before clipping, of the last step


One call splits the batch into micro-batches, runs forward and backward under the plan's rung, weights
each micro-batch's loss by its share of the samples (or of the tokens, when `loss_fn` returns
`(loss_sum, count)`), steps the optimizer once and frees the gradients. The update equals a single
full-batch step, also when the last micro-batch is smaller. With `max_grad_norm` the gradient of the
whole batch is clipped once before the step (`clipping.py`), and `before_optimizer_step` /
`after_optimizer_step` callbacks run around it.

When a micro-step runs out of memory (a longer sequence than the trials saw, a neighbour on the GPU), the
partial gradients are dropped, memory is cleaned after the `except` block has been left, and the same
batch is re-run with half the micro-batch and twice the accumulation: no sample lost or counted twice,
optimizer and GradScaler untouched; buffers the failed attempt updated (BatchNorm's running statistics) and
the random streams are put back first (`buffers.py`), so the re-run leaves no trace of it. At micro-batch 1
(2 for a model whose batch statistics need two samples, `plan.min_micro_batch_size`) the step moves up a
rung (checkpointing, then offload) within the techniques `fit` was given; past the top it raises
`NoFeasiblePlan`. Each recovery marks the old plan unsafe in the plan cache it came from (`plan.cache`) and
stores the new one there. On the simulated CPU device the step enforces the same ceiling the trials did
(`SimulatedCeiling` over the plan's budget), so all of this runs without a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
from torch import nn

from ..workload import batch as batches
from .. import parallel
from ..workload.accumulation import LossWeights, weighted_loss
from ..workload.batching import smallest_micro_batch, solve_accumulation, split_sizes
from ..devices import host as host_memory
from ..devices.ceiling import SimulatedCeiling
from ..devices.headroom import shortfall
from ..devices.placement import Placement, refuse_meta, release_memory, resolve_device
from ..errors import DeviceError, InvalidSetting, NoFeasiblePlan, is_device_poisoned, is_oom, needs_more_samples
from ..workload.losses import APPLY_CALL, LossFn, LossForm, MissingLoss, label_counts, resolve
from . import clipping
from .buffers import BufferGuard
from .eight_bit_link import EightBitLink
from .model_link import ModelLink
from .offload_link import OffloadLink
from ..workload.optimizers import OptimizerSpec
from ..configuration import CHECKPOINTING, OFFLOAD, Rung, none_on_the_host
from ..evidence import Trial
from ..plan import Plan
from ..settings import FitSettings
from ..sizes import format_bytes
from ..techniques import (AppliedRung, apply_rung, block_count, dtype_conflict, find_blocks, is_float64, ladder,
                          parse_techniques, serve_dtypes)
from ..techniques import optimizer_8bit
from ..techniques.offload import HostOptimizer
from ..techniques.sharding import is_sharded, reset_after_failure, shard_for_training

log = logging.getLogger(__name__)

ARMED_STEPS = 3  # sharded: steps of a plan (or after an OOM) that check in before each FSDP collective

StepHook = Callable[["TrainingStep"], Any]  # before_optimizer_step / after_optimizer_step: fn(step)


@dataclass(frozen=True, kw_only=True, slots=True)
class Recovery:
    """One OOM met in training, and what the step did about it."""

    step: int  # index of the optimizer step (calls to `step(batch)`) it happened in, from 0
    failed: str  # the configuration that ran out of memory, e.g. "bf16 at micro-batch 8"
    micro_step: int  # which micro-batch of the batch (from 0) ran out of memory; -1 when another rank did
    now: str  # the configuration the batch is re-run with
    shapes: dict[str, list[int]]  # each tensor's shape in the micro-batch that failed, e.g. {"[0]": [8, 4096]}
    seconds: float  # wall time of the failed attempt and its clean-up: the time lost
    note: str  # the error's first line


class TrainingStep:
    """A model and optimizer trained under a `Plan`; call it with a batch to take one optimizer step.

    Args:
        plan: the plan to train with (from `autotune.fit`, or built directly).
        model: the model the plan was made for, on the plan's device.
        optimizer: the optimizer to step; None builds AdamW. Under optimizer offload its state moves
            into a `HostOptimizer` (see `optimizer` below).
        loss_fn: `(model, batch) -> loss` (a mean over the batch's samples) or `-> (loss_sum, count)`
            for losses averaged over tokens with padding; default `model(...).loss` or a scalar output.
        techniques: rungs recovery may climb to, a subset of ("bf16", "checkpointing", "offload");
            default those `fit` was given (`plan.techniques`), else $AUTOTUNE_TECHNIQUES, else all. The
            plan's precision is never changed.
        grow_after: after this many clean optimizer steps at a micro-batch smaller than the plan
            started with, try doubling it back (an OOM halves it again and doubles the wait); None
            (the default) never grows.
        max_grad_norm: clip the L2 norm of the whole global batch's gradient to this, after the
            micro-batches were accumulated, the ranks' gradients reduced and (FP16) unscaled: the same
            update as `torch.nn.utils.clip_grad_norm_` on one full-batch step. None (default) does not
            clip; `float("inf")` measures the norm without clipping. `step.last_grad_norm` is the norm
            before clipping.
        before_optimizer_step: called as `fn(step)` once per optimizer step, after clipping and before
            the optimizer steps (the gradients are final: reduced over ranks, unscaled except under FP16
            optimizer offload, where the host unscales them). Not called for an attempt that ran out of
            memory and is re-run.
        after_optimizer_step: called as `fn(step)` after the optimizer stepped, before the gradients
            are freed.

    Under optimizer offload the user's `optimizer` is kept consistent rather than silently stale: its
    device state is moved to the host (and emptied on the device, which is the memory the rung saves);
    hyperparameters set on it, such as an LR scheduler's `lr`, are copied to the host optimizer before
    every step; `optimizer.state_dict()` returns the live host state and `load_state_dict()` loads into
    it, so checkpoints stay right; calling `optimizer.step()` directly raises; `close()` puts the state
    back into it. `step.optimizer` is the optimizer actually stepped.
    """

    def __init__(self, plan: Plan, model: nn.Module, optimizer: torch.optim.Optimizer | Any = None,
                 loss_fn: LossFn | None = None, *, techniques: Any = None, grow_after: int | None = None,
                 max_grad_norm: float | None = None, before_optimizer_step: StepHook | None = None,
                 after_optimizer_step: StepHook | None = None) -> None:
        if not isinstance(plan, Plan):
            raise InvalidSetting(f"plan must be an autotune.Plan, got {type(plan).__name__}")
        if not isinstance(model, nn.Module):
            raise InvalidSetting(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if grow_after is not None and (not isinstance(grow_after, int) or grow_after < 1):
            raise InvalidSetting(f"grow_after must be a positive number of steps or None, got {grow_after!r}")
        for name, hook in (("before_optimizer_step", before_optimizer_step),
                           ("after_optimizer_step", after_optimizer_step)):
            if hook is not None and not callable(hook):
                raise InvalidSetting(f"{name} must be a callable taking the step, got {type(hook).__name__}")
        refuse_meta(model)
        _refuse_second_step(model)
        self.max_grad_norm = clipping.check_max_norm(max_grad_norm)
        self.before_optimizer_step = before_optimizer_step
        self.after_optimizer_step = after_optimizer_step
        self.last_grad_norm: float | None = None  # set when max_grad_norm is: the norm before clipping
        self.plan = plan
        self.model = model
        self.loss_fn = resolve(loss_fn, model, chunked="chunked_loss" in _allowed(plan, techniques))
        self._loss_form = LossForm.of(model)  # whether the default loss passes num_items_in_batch; what it holds
        self._loss_notes: set[str] = set()  # the kinds of note said about the loss's parts (`_tell_loss`)
        self.placement = _placement(plan, model)
        short = shortfall(plan.peak_memory_bytes, self.placement, "the plan")  # memory taken since tuning?
        if short is not None:
            log.warning("autotune: %s", short)
        _check_host(plan)
        if plan.sharding == "fsdp2" and not is_sharded(model):  # fit chose FSDP2: shard here, for good
            _shard(plan, model, optimizer)
        self.spec = OptimizerSpec.from_user(optimizer, model)
        self.blocks = find_blocks(model, plan.block_paths)  # the blocks, and their order, the plan was tuned with
        if plan.checkpointed_blocks is None:  # the label's default, as a count: recovery compares counts
            self.plan = dataclasses.replace(plan, checkpointed_blocks=block_count(plan.rung, self.blocks))
        why = dtype_conflict(self.plan.rung, model)
        if why is not None:
            raise InvalidSetting(f"plan ({self.plan.rung.name}) cannot train this model: {why.split(': ', 1)[1]}; "
                                 "tune again with autotune.fit on this model, or use a plan with optimizer offload")
        self._sharded = parallel.active() and is_sharded(model)  # FSDP2: it reduces the gradients itself
        self._replicated = parallel.active() and not self._sharded  # autotune reduces them (OverlappedReduce)
        if self._sharded:
            parallel.guard_collectives(model)  # ranks that leave an OOM'd step at the same collective
        self._last_loss: torch.Tensor | None = None  # the last micro-batch's loss, until its backward
        self._last_index = 0
        self.rungs = _climbable_rungs(plan, techniques, self.placement, self.blocks, model)
        self.grow_after = grow_after
        self.recoveries: list[Recovery] = []
        self.last_peak_bytes: int | None = None  # simulated device only: the last step's peak
        self.steps_taken = 0
        # The device optimizer whose state carries across rungs: the user's, or the one the first
        # rung builds when none was given. None only when a rung built a HostOptimizer from scratch.
        self._device_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        self._link: OffloadLink | None = None
        self._model_link: ModelLink | None = None
        self._eight_link: EightBitLink | None = None
        self._eight_bit: Any = None  # the 8-bit optimizer of an 8-bit plan (techniques.optimizer_8bit)
        self._grow_cap = plan.micro_batch_size  # growing back never goes past what the tuning chose
        self._grow_wait = grow_after or 0
        self._clean_steps = 0
        self._probing = False
        self._warned_size = False
        self._warned_length = False
        self._micro_step = -1  # the micro-batch running now, for the record of a recovery
        self._micro_size = 0  # and its number of samples
        self._too_few = False  # the last attempt failed on batch statistics over a 1-sample micro-batch
        self._buffers = BufferGuard(model, self.placement.torch_device)
        self._applied = self._apply(plan.rung)
        _OPEN[model] = weakref.ref(self)

    # -- the public surface ----------------------------------------------------------------------------
    @property
    def optimizer(self) -> Any:
        """The optimizer stepped: the user's, the default AdamW, or a `HostOptimizer` under optimizer offload."""
        return self._applied.optimizer

    def __call__(self, batch: Any) -> float:
        """One optimizer step over `batch` (this rank's share of a global batch); returns the mean loss.

        Raises:
            NoFeasiblePlan: the batch does not fit even at micro-batch 1 on the top rung allowed.
            DeviceError: a CUDA error that is not an OOM; restart the process.
        """
        if self._applied is None:
            raise InvalidSetting("this TrainingStep was closed; call plan.apply(model, optimizer) again")
        # A batch on the host goes to the device a micro-batch at a time (`_accumulate`); its shared tensors once.
        batch = batches.shared_to_device(batch, self.placement.torch_device)
        n = batches.batch_size(batch, "step(batch)")
        self._check_size(n)
        self._check_length(batch)
        self._maybe_grow()
        failed: list[Trial] = []
        while True:
            started = time.perf_counter()
            self._buffers.save()  # running statistics, RNG: what the attempt changes besides gradients
            try:
                loss, failure = self._attempt(batch, n)
            except MissingLoss as exc:  # the model's own loss is missing: a loss_fn goes to plan.apply here
                raise exc.passed_to(APPLY_CALL) from exc.__cause__
            if not failure:
                self._buffers.learn()
                break
            if isinstance(self._applied.optimizer, HostOptimizer):
                self._applied.optimizer.abort()  # chunks stepped during the failed backward stay stepped
            self._clean_steps = 0  # the re-run checks in (`_oom_likely`): this batch just ran out of memory
            self._clean_up()  # out here, not in an except block: nothing pins the failed step's tensors
            self._buffers.restore()  # the re-run starts where the failed attempt did: no trace of it left
            if self._too_few:
                self._balance(failure)
            else:
                self._recover(batch, failure, failed, started)
        self.steps_taken += 1
        self._clean_steps = 0 if failed else self._clean_steps + 1
        if self._clean_steps >= self._grow_wait:
            self._probing = False  # a grown micro-batch that held for a whole wait has proven itself
        return loss

    def state_dict(self) -> dict[str, Any]:
        """What the step itself carries from one optimizer step to the next, for a checkpoint beside the model's
        and the optimizer's: FP16's loss scale (its GradScaler's state). Empty under BF16 and FP32."""
        scaler = self._applied.scaler if self._applied is not None else None
        return {"scaler": scaler.state_dict()} if scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume what `state_dict()` saved (a checkpoint of another plan's precision loads nothing here)."""
        scaler = self._applied.scaler if self._applied is not None else None
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])

    def close(self) -> None:
        """Undo the plan's techniques on the model and hand the optimizer state back to the user's optimizer."""
        if self._applied is not None:
            self._teardown()
            self._applied = None  # type: ignore[assignment]
            if _OPEN.get(self.model, lambda: None)() is self:
                del _OPEN[self.model]

    def __enter__(self) -> TrainingStep:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- one attempt at a global step -----------------------------------------------------------------
    def _attempt(self, batch: Any, n: int) -> tuple[float, str]:
        """Run the whole batch and step: (mean loss, "") on success, else (nan, the OOM's first line)."""
        self._micro_step = -1
        if self._link is not None:
            self._link.sync_hyperparameters()  # before backward: overlapped offload steps during the last one
        elif self._applied.rung.optimizer_8bit and self._device_optimizer is not None:
            # The user's optimizer is not stepped under an 8-bit plan; its LR (a scheduler's) still rules.
            optimizer_8bit.sync_hyperparameters(self._device_optimizer, self._applied.optimizer, self.spec)
        with self._memory_guard(batch), parallel.armed(self._sharded and self._oom_likely()):
            weights, failure = self._guarded(self._accumulate, batch, n)
            # Every rank learns of an OOM on any rank before anyone steps (PEERS.md lesson 10). Under FSDP no
            # collective of autotune's runs between the first micro-batch and this point (the counts are summed
            # before it, where every rank arrives), so a rank that failed early and ranks that ran every
            # micro-batch meet here, and all of them re-run the batch. Replicated ranks meet only after the last
            # backward: a rank that failed earlier skips it but still starts every all-reduce (below), so this
            # agreement, which waits for the device right before the last backward, is not needed there.
            if not self._replicated and parallel.agree_oom(bool(failure)):
                self._last_loss = None  # another rank failed: this rank's last graph is dropped unused
                return float("nan"), failure or "another rank ran out of memory"
            # The last micro-batch's backward runs only now: replicated ranks all-reduce their gradients while it
            # runs (`parallel.OverlappedReduce`), and a rank that runs out of memory in it (or before it) still
            # starts every all-reduce, so the ranks meet again here and agree before anyone uses a gradient.
            with self._reduction(None if failure else weights) as reduction:
                if not failure:
                    _, failure = self._guarded(self._last_backward, weights)
            if parallel.agree_oom(bool(failure)):
                self._last_loss = None  # another rank failed: this rank's last graph is dropped unused
                return float("nan"), failure or "another rank ran out of memory"
            loss = self._finish(weights, reduction)
            self._clip()
            if self.before_optimizer_step is not None:
                self.before_optimizer_step(self)
            self._optimizer_step()
        if self.after_optimizer_step is not None:
            self.after_optimizer_step(self)
        self._drop_gradients()  # set_to_none: see _drop_gradients
        return float(loss), ""

    def _oom_likely(self) -> bool:
        """A plan's first steps, those after a recovery, and a grown micro-batch still on trial: where ranks
        check in before each FSDP collective (`parallel.armed`); every rank decides alike (agreed history)."""
        return self._clean_steps < ARMED_STEPS or self._probing

    def _guarded(self, run: Callable[..., Any], *args: Any) -> tuple[Any, str]:
        # The micro-steps' tensors live in `run`'s frame; returning from here releases the
        # exception, its traceback, and with them that frame (pytorch #27600).
        try:
            return run(*args), ""
        except Exception as exc:  # noqa: BLE001 - classified here; anything not an OOM propagates untouched
            if is_device_poisoned(exc):
                raise DeviceError(f"CUDA error in a training step ({self._config()}): {exc}. The CUDA context "
                                  "is unusable; restart the process.") from exc
            if needs_more_samples(exc) and self._micro_size == 1 and self.plan.min_micro_batch_size < 2:
                self._too_few = True  # a plan made before the model was seen to need 2 (or by hand): re-split
                return None, _first_line(exc)
            if not is_oom(exc):
                raise
            return None, _first_line(exc)

    def _accumulate(self, batch: Any, n: int) -> LossWeights:
        """Forward and backward over every micro-batch but the last one's backward (`_last_backward`); the
        weights, which `_finish` turns into the loss."""
        applied = self._applied
        sizes = split_sizes(n, self.plan.micro_batch_size, self.plan.min_micro_batch_size)
        # A smaller odd one out runs first: the last backward is the one optimizer offload overlaps its
        # step with, and a full one gives it the most time (W1: 7 x 10 with a 1 ended on a tiny backward).
        sizes = sorted(sizes)
        counts = label_counts(self.model, batch)  # label tokens per sample, counted before the first forward
        weights = self._loss_weights(n, len(sizes), counts)
        start = 0
        for index, size in enumerate(sizes):
            self._micro_step, self._micro_size = index, size
            micro = applied.inputs(batches.to_device(batches.take(batch, start, start + size),
                                                     self.placement.torch_device))
            expected = None if counts is None else float(counts[start:start + size].sum())
            start += size
            with applied.autocast():
                loss = weighted_loss(self.loss_fn, self.model, micro, weights, size, expected=expected,
                                     form=self._loss_form)
            if index == len(sizes) - 1:
                self._last_loss, self._last_index = loss, index  # its graph, kept for _last_backward
            elif loss is not None:
                applied.backward(loss)
            del loss, micro  # free the graph's last references before the next forward
        self._micro_step = -1  # all ran: an OOM reported now came from another rank
        return weights

    def _overlap_allowed(self, weights: LossWeights) -> bool:
        """Whether the host may take each gradient as final in the last backward (overlapped optimizer
        offload): not when something changes the device gradients after backward (a reduction over ranks,
        the token-count correction, a callback before the step). Clipping and loss scaling do not: the
        host applies them to its own copies, after backward (`defer`)."""
        return (not parallel.active() and not self._sharded and self.before_optimizer_step is None
                and not weights.needs_correction())

    def _reduction(self, weights: LossWeights | None) -> ContextManager[parallel.OverlappedReduce | None]:
        """Replicated on several ranks: the all-reduce that overlaps the last backward (None: this rank ran out
        of memory before it, and only joins the all-reduces); else nothing to do."""
        if not self._replicated:
            return contextlib.nullcontext()
        return parallel.OverlappedReduce(self.model, weights, overlap=self.plan.reduce_overlap is not False)

    def _last_backward(self, weights: LossWeights) -> None:
        """The last micro-batch's backward; the optimizer steps right after it (overlapped offload arms here)."""
        loss, self._last_loss = self._last_loss, None  # this frame owns the graph now: an OOM frees it with it
        self._micro_step = self._last_index
        if loss is not None:
            self._applied.backward(loss, last=self._overlap_allowed(weights), defer=self.max_grad_norm is not None)
        self._micro_step = -1

    def _finish(self, weights: LossWeights, reduction: parallel.OverlappedReduce | None) -> torch.Tensor:
        """Make the accumulated gradients the whole global batch's; the mean loss over it, detached.

        One process: the token-count correction. Under torch.distributed (the model replicated): every
        rank's share rescaled and summed over ranks during the last backward (`parallel.OverlappedReduce`),
        so the update equals one full-batch step on one process and every rank returns the same loss.
        """
        self._tell_loss("parts", self._loss_form.note)
        if self._sharded:
            return parallel.finish_sharded(self.model, weights)
        if reduction is not None:
            self._tell_loss("estimate", weights.inexact(reduction.factor))
            return reduction.wait(weights)
        self._tell_loss("estimate", weights.inexact())
        weights.correct(self.model)
        return weights.mean_loss()

    def _tell_loss(self, kind: str, note: str | None) -> None:
        """Say once of each `kind`, in a warning and in `plan.reason`, what of the loss could not be weighted
        part by part."""
        if note is None or kind in self._loss_notes:
            return
        self._loss_notes.add(kind)
        log.warning("autotune: %s", note)
        if note not in self.plan.reason:
            reason = f"{self.plan.reason}; {note}" if self.plan.reason else note
            self.plan = dataclasses.replace(self.plan, reason=reason)

    def _loss_weights(self, n: int, steps: int, counts: torch.Tensor | None) -> LossWeights:
        tokens = None if counts is None else float(counts.sum())
        if not self._sharded:
            if not parallel.active():
                return LossWeights(n, steps, total=tokens)
            # The global samples and label tokens, known before the first micro-batch (every rank gets
            # here before any can fail), so each rank weighs by them directly (issue 17).
            samples, total = parallel.sum_over_ranks([float(n), tokens or 0.0])
            return LossWeights(n, steps, divisor=samples, total=None if tokens is None else total, summed=True)
        # FSDP averages the gradients over ranks inside backward, so every rank must weigh alike: n_i over
        # (global samples / world) for mean losses, plain sums for token losses (finish_sharded divides by
        # the global count). The sum runs before any micro-batch, where every rank arrives.
        world = parallel.world_size()
        total, fewest, most = parallel.total_and_range(n, steps)
        if fewest != most:  # FSDP's collectives run in every micro-step: unequal counts would leave one waiting
            raise InvalidSetting(f"under FSDP every rank must run the same number of micro-batches, but they range "
                                 f"from {fewest} to {most} at micro-batch {self.plan.micro_batch_size}; give every "
                                 f"rank the same number of samples (global batch / world size)")
        return LossWeights(n, steps, divisor=total / world, estimate=1.0, sharded=True)

    def _clip(self) -> None:
        """Unscale (FP16) and clip the whole batch's gradient; see `clipping.py` for where each path does it."""
        applied = self._applied
        host = isinstance(applied.optimizer, HostOptimizer)
        if applied.scaler is not None and not host:
            applied.scaler.unscale_(applied.optimizer)  # scaler.step sees it was unscaled and does not repeat it
        if self.max_grad_norm is None:
            return
        if host:  # the device gradients give the norm; the host applies the factor to its FP32 copies
            scale = float(applied.scaler.get_scale()) if applied.scaler is not None else 1.0
            norm = clipping.global_norm(self.model, sharded=self._sharded, scale=scale)
            applied.optimizer.grad_factor = clipping.clip_factor(norm, self.max_grad_norm)
        else:
            norm = clipping.clip_model(self.model, self.max_grad_norm, sharded=self._sharded)
        self.last_grad_norm = norm

    def _optimizer_step(self) -> None:
        if self._link is not None:
            self._link.sync_hyperparameters()
        try:
            self._applied.optimizer_step()
            if self._link is not None:
                self._link.mirror()  # the first step creates the host state the user's optimizer shows
        except Exception as exc:
            if is_oom(exc):
                # Not retried: the micro-batch does not change the optimizer's memory, and a step that died
                # half-way may have updated some parameters already. Record it so the next fit is safer.
                log.error("autotune: out of memory inside optimizer.step() (%s); this is not recoverable "
                          "in-process", self._config())
                _tell_cache(self.plan, None, {}, f"OOM in optimizer.step(): {_first_line(exc)}")
            raise

    def _drop_gradients(self) -> None:
        # set_to_none=True, unlike the trials' AppliedRung.zero_grad: the trials keep the buffers to measure
        # the worst case (gradients live through the next forward); here freeing them lowers the peak of
        # the next first forward, never raises it, and makes an OOM's clean-up actually return the memory.
        for p in self.model.parameters():
            p.grad = None

    @contextlib.contextmanager
    def _memory_guard(self, batch: Any) -> Iterator[None]:
        """On the simulated device, the trials' ceiling over the plan's budget; on CUDA, the GPU itself."""
        if not self.placement.simulated:
            yield
            return
        ceiling = SimulatedCeiling(self.plan.memory_budget_bytes)
        with ceiling:
            opt = self._applied.optimizer
            ceiling.track([self.model, batch, opt if isinstance(opt, torch.optim.Optimizer) else []])
            try:
                yield
            finally:
                self.last_peak_bytes = ceiling.peak_bytes
                ceiling.close()  # detach finalizers: storages that outlive the step must not pin the ceiling

    def _clean_up(self) -> None:
        reset_after_failure(self.model)  # FSDP2: the failed attempt left blocks unsharded
        self._drop_gradients()
        gc.collect()
        try:
            release_memory(self.placement)
        except Exception as exc:  # noqa: BLE001 - classified here; anything else propagates untouched
            if is_device_poisoned(exc):  # an asynchronous error surfacing at the synchronize
                raise DeviceError(f"CUDA error while cleaning up after an OOM in training ({self._config()}): "
                                  f"{exc}. The CUDA context is unusable; restart the process.") from exc
            raise

    # -- recovery ------------------------------------------------------------------------------------
    def _recover(self, batch: Any, failure: str, failed: list[Trial], started: float) -> None:
        """Choose the next configuration after an OOM, or raise NoFeasiblePlan past the top."""
        old = self.plan
        shapes = _micro_batch_shapes(batch, old.micro_batch_size)
        failed.append(Trial(rung=old.rung, micro_batch_size=old.micro_batch_size, outcome="oom",
                            note=failure[:200]))
        if self._probing:
            self._grow_wait *= 2  # growing back failed before it held a whole wait: wait twice as long next time
            self._probing = False
        # The fewest samples a micro-batch may hold (2 under batch statistics; 3 for an odd batch at 2).
        lowest = smallest_micro_batch(old.per_rank_batch_size, old.min_micro_batch_size) or 1
        if old.micro_batch_size > lowest:
            micro = max(old.micro_batch_size // 2, lowest)
            new = _with(old, old.rung, micro, f"recovered from an OOM in training at micro-batch "
                                              f"{old.micro_batch_size}: halved to {micro}")
        else:
            rung = self._next_rung(old.rung)
            if rung is None:
                _tell_cache(old, None, shapes, failure)
                raise NoFeasiblePlan(_exhausted(failed, shapes, old), trials=tuple(failed))
            self._switch_rung(rung)
            new = _with(old, rung, lowest, f"recovered from an OOM in training at micro-batch {lowest} on "
                                           f"{old.rung.name}: moved up to {rung.name}")
        self.plan = new
        _tell_cache(old, new, shapes, failure)
        self.recoveries.append(Recovery(step=self.steps_taken, failed=_describe(old), micro_step=self._micro_step,
                                        now=_describe(new), shapes=shapes, note=failure,
                                        seconds=time.perf_counter() - started))
        log.warning("autotune: out of memory at %s (%s); re-running the same batch at %s x %d accumulation",
                    _describe(old), failure, _describe(new), new.accumulation_steps)

    def _balance(self, failure: str) -> None:
        """A 1-sample micro-batch failed on batch statistics: from now on none holds fewer than 2 (the same
        batch re-run with a balanced split). Not an OOM: the plan cache is not told the plan was unsafe."""
        self._too_few = False
        old = self.plan
        micro = max(old.micro_batch_size, smallest_micro_batch(old.per_rank_batch_size, 2) or 1)
        self.plan = _with(old, old.rung, micro, f"{failure} on a 1-sample micro-batch (batch statistics): every "
                                                 "micro-batch now holds 2 samples or more, the split balanced",
                          smallest=2)
        log.warning("autotune: %s on a micro-batch of 1 sample; re-running the same batch with at least 2 samples "
                    "per micro-batch (%s x %d)", failure, _describe(self.plan), self.plan.accumulation_steps)

    def _next_rung(self, current: Rung) -> Rung | None:
        """The cheapest allowed rung that keeps every technique in force and adds one."""
        for rung in self.rungs:
            if _strength(rung) != _strength(current) and _dominates(rung, current):
                return rung
        return None

    def _switch_rung(self, rung: Rung) -> None:
        scaler = self._applied.scaler
        scaler_state = scaler.state_dict() if scaler is not None else None
        old = self._applied.rung
        stepped = getattr(self._applied.optimizer, "skip", set())  # see HostOptimizer.abort
        self._teardown()
        try:
            self._applied = self._apply(rung)
        except BaseException:
            self._applied = self._apply(old)  # never leave the step holding a rung already removed
            raise
        if stepped and isinstance(self._applied.optimizer, HostOptimizer):
            # Rare: an OOM in the last backward at micro-batch 1 after the host had stepped some chunks.
            # They keep their update (not stepped twice); the re-run sees their new weights.
            self._applied.optimizer.skip = stepped & set(self._applied.optimizer.host_index)
            log.warning("autotune: %d parameter tensors were updated before the out-of-memory error and keep "
                        "that update on %s", len(stepped), rung.name)
        if scaler_state and self._applied.scaler is not None:
            self._applied.scaler.load_state_dict(scaler_state)  # the loss scale carries over

    def _maybe_grow(self) -> None:
        """After `grow_after` clean steps below the tuned micro-batch, try doubling it back."""
        micro = self.plan.micro_batch_size
        if not self.grow_after or micro >= self._grow_cap or self._clean_steps < self._grow_wait:
            return
        bigger = min(2 * micro, self._grow_cap)
        self.plan = _with(self.plan, self.plan.rung, bigger,
                          f"grown back to micro-batch {bigger} after {self._clean_steps} clean steps")
        self._probing = True
        self._clean_steps = 0
        log.info("autotune: trying micro-batch %d again after %d clean steps", bigger, self._grow_wait)

    # -- rungs ---------------------------------------------------------------------------------------
    def _apply(self, rung: Rung) -> AppliedRung:
        planned = rung == self.plan.rung
        fraction = self.plan.offload_fraction if planned and self.plan.offload == "optimizer" else 1.0  # 0: partitioned
        given = self._eight_bit if rung.optimizer_8bit and self._eight_bit is not None else self._device_optimizer
        applied = apply_rung(self.model, rung, self.spec, self.placement, self.blocks, optimizer=given,
                             offload_fraction=fraction, overlap=self.plan.offload_overlap if planned else None)
        if rung.optimizer_8bit:
            self._eight_bit = applied.optimizer  # its 8-bit state carries across rungs (recovery)
            if self._device_optimizer is not None and self._device_optimizer is not applied.optimizer:
                self._eight_link = EightBitLink(self._device_optimizer, applied.optimizer)
        elif isinstance(applied.optimizer, HostOptimizer):
            applied.optimizer.gather_on_restore = True  # partitioned over ranks: close() gathers weights and state
            self._model_link = ModelLink(self.model, applied.optimizer)
            if self._device_optimizer is not None:
                self._link = OffloadLink(self._device_optimizer, applied.optimizer)
        elif self._device_optimizer is None:
            self._device_optimizer = applied.optimizer  # built from the spec: keep its state across rungs
        return applied

    def _teardown(self) -> None:
        link, self._link = self._link, None
        model_link, self._model_link = self._model_link, None
        eight_link, self._eight_link = self._eight_link, None
        if eight_link is not None:
            eight_link.close()
        if model_link is not None:
            model_link.close()  # before the weights come back: the parameters are the truth again
        self._applied.remove()  # under optimizer offload: FP32 weights back on the device
        self._drop_gradients()
        if link is not None:
            link.close()

    # -- small helpers -------------------------------------------------------------------------------
    def _check_size(self, n: int) -> None:
        if n != self.plan.per_rank_batch_size and not self._warned_size:
            self._warned_size = True
            log.warning("autotune: step(batch) got %d samples but the plan was made for %d per rank; the step is "
                        "still exact for the batch it gets (global batch = what you pass)",
                        n, self.plan.per_rank_batch_size)

    def _check_length(self, batch: Any) -> None:
        """Warn once when a batch is longer than the longest sequence the plan was tuned for (`max_length`)."""
        length = batches.tokens_per_sample(batch)
        if self._warned_length or self.plan.max_length is None or length is None or length <= self.plan.max_length:
            return
        self._warned_length = True
        log.warning("autotune: a batch of %d tokens per sample is longer than the %d the plan was tuned for "
                    "(max_length): its peak may pass the plan's; tune with fit(..., max_length=%d) (autotune run "
                    "--max-length), or cut the batches", length, self.plan.max_length, length)

    def _config(self) -> str:
        return _describe(self.plan)


# The open step of each model: a second `apply` on top of the first would build its offload over the first's
# 16-bit working copies, and the two would each step the model, one update lost.
_OPEN: weakref.WeakKeyDictionary[nn.Module, weakref.ref[TrainingStep]] = weakref.WeakKeyDictionary()


def _refuse_second_step(model: nn.Module) -> None:
    ref = _OPEN.get(model)
    step = ref() if ref is not None else None
    if step is not None and step._applied is not None:
        raise InvalidSetting(f"this model already has an open training step (plan.apply was called on it before, "
                             f"{_describe(step.plan)}); call step.close() on that one first, or keep using it")


# -- plan arithmetic ---------------------------------------------------------------------------------------

def _with(plan: Plan, rung: Rung, micro: int, reason: str, *, smallest: int | None = None) -> Plan:
    """`plan` on `rung` at micro-batch `micro`, accumulation solved again for the same per-rank batch."""
    smallest = plan.min_micro_batch_size if smallest is None else smallest
    steps, last = solve_accumulation(plan.per_rank_batch_size, micro, smallest)
    return dataclasses.replace(plan, precision=rung.precision, checkpointing=rung.checkpointing,
                               checkpointed_blocks=rung.checkpointed_blocks, compile=rung.compile,
                               optimizer_8bit=rung.optimizer_8bit,
                               offload=rung.offload,
                               offload_fraction=plan.offload_fraction if rung == plan.rung else None,
                               micro_batch_size=min(micro, plan.per_rank_batch_size), accumulation_steps=steps,
                               last_micro_batch_size=last, reason=reason, min_micro_batch_size=smallest)


def _strength(rung: Rung) -> tuple[int, int, int]:
    # The count breaks ties between two "selective" rungs; None (the label's default) counts as the label.
    return OFFLOAD.index(rung.offload), CHECKPOINTING.index(rung.checkpointing), rung.checkpointed_blocks or 0


def _dominates(a: Rung, b: Rung) -> bool:
    """`a` is at least as strong as `b` in checkpointing and in offload: recovery climbs the ladder's
    order but never trades checkpointing away for offload (when the allowed techniques would)."""
    return all(x >= y for x, y in zip(_strength(a), _strength(b)))


def _allowed(plan: Plan, techniques: Any) -> frozenset[str]:
    """The step's `techniques`, else what fit was allowed (`plan.techniques`), else $AUTOTUNE_TECHNIQUES or all."""
    if techniques is None and plan.techniques is not None:
        techniques = plan.techniques  # what fit was allowed: recovery never climbs past it
    return parse_techniques(FitSettings.resolve(techniques=techniques).techniques)


def _climbable_rungs(plan: Plan, techniques: Any, placement: Placement, blocks: Any, model: nn.Module) -> list[Rung]:
    """The ladder recovery may climb, in the plan's precision (recovery never changes the numerics)."""
    allowed = set(_allowed(plan, techniques))
    if plan.precision == "fp32":
        allowed.discard("bf16")  # and optimizer offload with it, but for float64 weights (see `ladder`)
    else:
        allowed.add("bf16")
    rungs, _ = ladder(frozenset(allowed), placement, blocks, compile=plan.compile,  # compile stays as tuned
                      float64=is_float64(model))
    # An 8-bit plan keeps its 8-bit state (recovery never changes the numerics) and so never climbs to
    # optimizer offload, whose host optimizer keeps FP32 state.
    rungs = [dataclasses.replace(r, precision=plan.precision, optimizer_8bit=plan.optimizer_8bit) for r in rungs
             if not (plan.optimizer_8bit and r.offload == "optimizer")]
    rungs, _ = serve_dtypes(rungs, model)
    return rungs


def _check_host(plan: Plan) -> None:
    """Warn, with both figures, when the host has less memory available now than the plan allocates there."""
    available = host_memory.available_bytes()
    if plan.host_peak_bytes and available < plan.host_peak_bytes:
        log.warning("autotune: the plan allocates %s of host memory (%s) and %s is available now; free host "
                    "memory or tune again with host_memory_budget (autotune run --host-budget) at most %s",
                    format_bytes(plan.host_peak_bytes), plan.rung.name, format_bytes(available),
                    format_bytes(available))


def _placement(plan: Plan, model: nn.Module) -> Placement:
    """Where the model is, checked against the device the plan was made for."""
    device = next((p.device for p in model.parameters()), torch.device(plan.device))
    if device.type != plan.device:
        raise InvalidSetting(f"the plan was made for device {plan.device!r} but the model is on {device}; move the "
                             f"model with model.to({plan.device!r}) before creating the optimizer")
    return resolve_device(device)


def _shard(plan: Plan, model: nn.Module, optimizer: Any) -> None:
    if not parallel.active():
        raise InvalidSetting("the plan shards the model with FSDP2 (plan.sharding='fsdp2') but torch.distributed "
                             "is not initialised: launch with torchrun as when tuning, or tune again on one process")
    shard_for_training(model, optimizer, precision=plan.precision)


def _describe(plan: Plan) -> str:
    partitioned = f", {none_on_the_host()}" if plan.partitioned_state else ""
    return f"{plan.rung.name}{partitioned} at micro-batch {plan.micro_batch_size}"


def _micro_batch_shapes(batch: Any, micro: int) -> dict[str, list[int]]:
    """{tensor path: shape} of a micro-batch of `micro` samples of `batch`: what the cache records."""
    return {path or "batch": [micro, *shape] for path, shape, _ in batches.signature(batch)}


def _exhausted(failed: list[Trial], shapes: dict[str, list[int]], plan: Plan) -> str:
    tried = ", ".join(f"{t.rung.name} at micro-batch {t.micro_batch_size}" for t in failed)
    shape = "; ".join(f"{path} {tuple(s)}" for path, s in shapes.items())
    return (f"a micro-batch of [{shape}] does not fit in the memory budget of "
            f"{format_bytes(plan.memory_budget_bytes)}: out of memory at {tried}, and no higher rung is "
            "allowed. Shorten the inputs, raise memory_budget, or allow more techniques "
            "(techniques=('bf16', 'checkpointing', 'offload')).")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _tell_cache(old: Plan, new: Plan | None, shapes: dict[str, list[int]], note: str) -> None:
    """Mark `old` unsafe for `shapes` and store `new` under its key, in the cache the plan came from.

    That is `old.cache`, the `PlanCache` `fit` used (a path or a store the user passed), never another; a
    plan without one (built by hand, read from JSON) goes to the default cache ($AUTOTUNE_CACHE, "off"
    honoured as in `fit`). The store is closed afterwards (it reopens when used again): recoveries are rare,
    and training should hold no connection between them. Whatever the cache does, training goes on.
    """
    if not old.key or not parallel.is_writer():
        return
    try:
        store = old.cache if old.cache is not None else _default_cache()
        if store is None:
            return
        try:
            store.mark_unsafe(old.key, micro_batch_size=old.micro_batch_size, shapes=shapes, note=note[:200])
            if new is not None:
                store.replace(old.key, new)
        finally:
            store.close()
    except Exception as exc:  # noqa: BLE001 - the cache must never break training
        log.warning("autotune: could not record the OOM in the plan cache (%s); training goes on", exc)


def _default_cache() -> Any:
    from ..cache import store as cache  # the cache sits beside training, imported only when a recovery writes

    return cache.open_cache(FitSettings.resolve(cache=None).cache)  # a path, False for "off", or None
