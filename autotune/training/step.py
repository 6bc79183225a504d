"""`plan.apply()`: the training step, with exact gradient accumulation and recovery from OOM mid-training.
`step = plan.apply(model, optimizer)`; `loss = step(batch)` takes one optimizer step over this rank's share of a
global batch; `step.plan` is the plan in force (smaller, or a higher rung, after a recovery).

One call splits the batch into micro-batches and accumulates them exactly (`accumulate.py`), clips the
whole batch's gradient once when asked (`clipping.py`), runs the `before_optimizer_step` /
`after_optimizer_step` callbacks around the optimizer step and frees the gradients. The rung in force and
its optimizer offload live in `rungs.py`.

When a micro-step runs out of memory (a longer sequence than the trials saw, a neighbour on the GPU), the
partial gradients are dropped, memory is cleaned after the `except` block has been left, buffers and random
streams are put back (`buffers.py`), and the same batch is re-run under the configuration the recovery
policy gives (`recovery.py`: half the micro-batch, else the next rung up within the techniques `fit` was
given; past the top `NoFeasiblePlan`): no sample lost or counted twice, optimizer and GradScaler untouched.
Each recovery is reported to the callback `fit` kept with the plan it returned (`plan.learned.report`; it
records the recovery in fit's plan cache). On the simulated CPU device the step enforces the same
ceiling the trials did (`SimulatedCeiling` over the plan's budget), so all of this runs without a GPU.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import parallel
from ..devices.ceiling import SimulatedCeiling
from ..devices.placement import release_memory
from ..errors import DeviceError, InvalidSetting, NoFeasiblePlan, is_device_poisoned, is_oom, needs_more_samples
from ..evidence import Finding, Trial
from ..parallel.deaths import named_deaths
from ..techniques import dtype_conflict, find_blocks, static_at
from ..techniques.sharding import is_sharded, reset_after_failure
from ..workload import batch as batches
from ..workload.losses import APPLY_CALL, LossFn, MissingLoss, resolve
from ..workload.optimizers import OptimizerSpec
from . import checks, clipping, recovery
from .accumulate import Accumulator
from .buffers import BufferGuard
from .recovery import Recovery
from .rungs import RungInForce

if TYPE_CHECKING:  # plan.py sits above training/ and imports it
    from ..plan import Plan

log = logging.getLogger(__name__)

ARMED_STEPS = 3  # sharded: steps of a plan (or after an OOM) that check in before each FSDP collective
StepHook = Callable[["TrainingStep"], Any]  # before_optimizer_step / after_optimizer_step: fn(step)
__all__ = ["Recovery", "TrainingStep"]


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

    Under optimizer offload the user's `optimizer` is kept consistent rather than silently stale: its device state is
    moved to the host (and emptied on the device, which is the memory the rung saves); hyperparameters set on it, such
    as an LR scheduler's `lr`, are copied to the host optimizer before every step; `optimizer.state_dict()` returns
    the live host state and `load_state_dict()` loads into it, so checkpoints stay right; calling `optimizer.step()`
    directly raises; `close()` puts the state back into it. `step.optimizer` is the optimizer actually stepped.

    Large: a batch retried after an OOM needs at once the plan, model, optimizer, loss, hooks and recovery state."""

    def __init__(self, plan: Plan, model: nn.Module, optimizer: torch.optim.Optimizer | Any = None,
                 loss_fn: LossFn | None = None, *, techniques: Any = None, grow_after: int | None = None,
                 max_grad_norm: float | None = None, before_optimizer_step: StepHook | None = None,
                 after_optimizer_step: StepHook | None = None) -> None:
        if grow_after is not None and (not isinstance(grow_after, int) or grow_after < 1):
            raise InvalidSetting(f"grow_after must be a positive number of steps or None, got {grow_after!r}")
        for name, hook in (("before_optimizer_step", before_optimizer_step),
                           ("after_optimizer_step", after_optimizer_step)):
            if hook is not None and not callable(hook):
                raise InvalidSetting(f"{name} must be a callable taking the step, got {type(hook).__name__}")
        self.placement = checks.prepare(plan, model, optimizer)
        self.max_grad_norm = clipping.check_max_norm(max_grad_norm)
        self.before_optimizer_step = before_optimizer_step
        self.after_optimizer_step = after_optimizer_step
        self.last_grad_norm: float | None = None  # set when max_grad_norm is: the norm before clipping
        self.plan = plan
        self.model = model
        self.spec = OptimizerSpec.from_user(optimizer, model)
        self.blocks = find_blocks(model, plan.block_paths)  # the blocks, and their order, the plan was tuned with
        self.plan = recovery.counted(plan, self.blocks)  # a count recovery can compare; no blocks: refused
        why = dtype_conflict(self.plan.rung, model)
        if why is not None:
            raise InvalidSetting(f"plan ({self.plan.rung.name}) cannot train this model: {why.split(': ', 1)[1]}; "
                                 "tune again with autotune.fit on this model, or use a plan with optimizer offload")
        self._sharded = parallel.active() and is_sharded(model)  # FSDP2: it reduces the gradients itself
        if self._sharded:
            parallel.guard_collectives(model)  # ranks that leave an OOM'd step at the same collective
        loss_fn = resolve(loss_fn, model, chunked="chunked_loss" in recovery.allowed(plan, techniques))
        self._accumulator = Accumulator(model, loss_fn, self.placement, sharded=self._sharded)
        self._loss_notes: set[str] = set()  # the kinds of note said about the loss's parts (`_tell_loss`)
        self.rungs = recovery.climbable_rungs(plan, techniques, self.placement, self.blocks, model)
        self.grow_after = grow_after
        self.recoveries: list[Recovery] = []
        self.last_peak_bytes: int | None = None  # simulated device only: the last step's peak
        self.steps_taken = 0
        self._grow_cap = plan.micro_batch_size  # growing back never goes past what the tuning chose
        self._grow_wait = grow_after or 0
        self._clean_steps = 0
        self._probing = False
        self._batch_warnings = checks.BatchWarnings()
        self._too_few = False  # the last attempt failed on batch statistics over a 1-sample micro-batch
        self._buffers = BufferGuard(model, self.placement.torch_device)
        self._in_force: RungInForce | None = RungInForce(model, self.spec, self.placement, self.blocks, optimizer,
                                                             self.plan.max_length)
        self._in_force.apply(self.plan.rung, fraction=recovery.host_share(self.plan), overlap=self.plan.offload_overlap,
                             sharding=self.plan.sharding)
        checks.opened(model, self)

    # -- the public surface ----------------------------------------------------------------------------
    @property
    def optimizer(self) -> Any:
        """The optimizer stepped: the user's, the default AdamW, or the offload engine under optimizer offload."""
        return self._applied.optimizer

    @property
    def loss_fn(self) -> Any:
        return self._accumulator.loss_fn

    @property
    def _applied(self) -> Any:
        return self._in_force.applied if self._in_force is not None else None

    @named_deaths()  # a rank that dies mid-step is named by node and local rank on the others
    def __call__(self, batch: Any) -> float:
        """One optimizer step over `batch` (this rank's share of a global batch); returns the mean loss.

        Raises:
            NoFeasiblePlan: the batch does not fit even at micro-batch 1 on the top rung allowed.
            DeviceError: a CUDA error that is not an OOM; restart the process.
        """
        if self._in_force is None:
            raise InvalidSetting("this TrainingStep was closed; call plan.apply(model, optimizer) again")
        # A batch on the host goes to the device a micro-batch at a time (`Accumulator`); its shared tensors once.
        batch = batches.shared_to_device(batch, self.placement.torch_device)
        n = batches.batch_size(batch, "step(batch)")
        self._accumulator.check_once(self._applied, self.plan, batch)  # the loss, where no check ran for it yet
        self._batch_warnings.check(self.plan, batch, n)
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
            self._in_force.abort()  # chunks stepped during the failed backward stay stepped
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
        if self._in_force is not None:
            self._in_force.remove(self._drop_gradients)
            self._in_force = None
            checks.closed(self.model, self)

    def _open(self) -> RungInForce:
        """The rung in force: every attempt runs inside `step`, which refuses a closed TrainingStep first."""
        assert self._in_force is not None, "this TrainingStep was closed"
        return self._in_force

    def __enter__(self) -> TrainingStep:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- one attempt at a global step -----------------------------------------------------------------
    def _attempt(self, batch: Any, n: int) -> tuple[float, str]:
        """Run the whole batch and step: (mean loss, "") on success, else (nan, the OOM's first line)."""
        acc = self._accumulator
        self._open().before_attempt()
        static = self.plan.micro_batch_size if self.plan.rung.compile else None  # its shape's graphs: static
        with self._memory_guard(batch), parallel.armed(self._sharded and self._oom_likely()), static_at(static):
            weights, failure = self._guarded(acc.forward, self._applied, self.plan, batch, n)
            # Every rank learns of an OOM on any rank before anyone steps. Under FSDP no collective of
            # autotune's runs between the first micro-batch and this point (the counts are summed before it,
            # where every rank arrives), so a rank that failed early and ranks that ran every micro-batch meet
            # here, and all of them re-run the batch. Replicated ranks meet only after the last backward: a rank
            # that failed earlier skips it but still starts every all-reduce (below), so this agreement, which
            # waits for the device right before the last backward, is not needed there.
            if not acc.replicated and parallel.agree_oom(bool(failure)):
                acc.drop_last()
                return float("nan"), failure or "another rank ran out of memory"
            # The last micro-batch's backward runs only now: replicated ranks all-reduce their gradients while it
            # runs (`parallel.OverlappedReduce`), and a rank that runs out of memory in it (or before it) still
            # starts every all-reduce, so the ranks meet again here and agree before anyone uses a gradient.
            overlap = self.plan.reduce_overlap is not False
            with acc.reduction(None if failure else weights, overlap=overlap) as reduction:
                if not failure:
                    callback = self.before_optimizer_step is not None
                    _, failure = self._guarded(acc.last_backward, self._applied, defer=self.max_grad_norm is not None,
                                               overlap=acc.overlap_allowed(weights, callback=callback))
            if parallel.agree_oom(bool(failure)):
                acc.drop_last()
                return float("nan"), failure or "another rank ran out of memory"
            loss = acc.finish(weights, reduction)
            for kind, note in acc.take_notes():
                self._tell_loss(kind, note)
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

    def _guarded(self, run: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, str]:
        # The micro-steps' tensors live in `run`'s frame; returning from here releases the
        # exception, its traceback, and with them that frame (pytorch #27600).
        try:
            return run(*args, **kwargs), ""
        except Exception as exc:  # classified here; anything not an OOM propagates untouched
            if is_device_poisoned(exc):
                raise DeviceError(f"CUDA error in a training step ({self._config()}): {exc}. The CUDA context "
                                  "is unusable; restart the process.") from exc
            if (needs_more_samples(exc) and self._accumulator.micro_size == 1
                    and self.plan.min_micro_batch_size < 2):
                self._too_few = True  # a plan made before the model was seen to need 2 (or by hand): re-split
                return None, recovery.first_line(exc)
            if not is_oom(exc):
                raise
            return None, recovery.first_line(exc)

    def _tell_loss(self, kind: str, note: str | None) -> None:
        """Say once of each `kind`, in a warning and in `plan.reason`, what of the loss could not be weighted
        part by part."""
        if note is None or kind in self._loss_notes:
            return
        self._loss_notes.add(kind)
        log.warning("autotune: %s", note)
        self.plan = self.plan.with_finding(Finding(kind="loss", clause=note, subject=kind), once=True)

    def _clip(self) -> None:
        """Unscale (FP16) and clip the whole batch's gradient; see `clipping.py` for where each path does it."""
        applied, offload = self._applied, self._open().offload
        if applied.scaler is not None and not offload.engaged:
            applied.scaler.unscale_(applied.optimizer)  # scaler.step sees it was unscaled and does not repeat it
        if self.max_grad_norm is None:
            return
        self.last_grad_norm = clipping.clip(self.model, self.max_grad_norm, offload, sharded=self._sharded,
                                            scaler=applied.scaler, seen=self.before_optimizer_step is not None)

    def _optimizer_step(self) -> None:
        try:
            self._open().step()
        except Exception as exc:
            if is_oom(exc):
                # Not retried: the micro-batch does not change the optimizer's memory, and a step that died
                # half-way may have updated some parameters already. Reported so the next fit is safer.
                log.error("autotune: out of memory inside optimizer.step() (%s); this is not recoverable "
                          "in-process", self._config())
                recovery.report(self.plan, None, {}, f"OOM in optimizer.step(): {recovery.first_line(exc)}")
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
        except Exception as exc:  # classified here; anything else propagates untouched
            if is_device_poisoned(exc):  # an asynchronous error surfacing at the synchronize
                raise DeviceError(f"CUDA error while cleaning up after an OOM in training ({self._config()}): "
                                  f"{exc}. The CUDA context is unusable; restart the process.") from exc
            raise

    # -- recovery ------------------------------------------------------------------------------------
    def _recover(self, batch: Any, failure: str, failed: list[Trial], started: float) -> None:
        """Move to the configuration the recovery policy gives after an OOM, or raise NoFeasiblePlan past the top."""
        old = self.plan
        shapes = recovery.micro_batch_shapes(batch, old.micro_batch_size)
        failed.append(Trial(rung=old.rung, micro_batch_size=old.micro_batch_size, outcome="oom", note=failure[:200]))
        if self._probing:
            self._grow_wait *= 2  # growing back failed before it held a whole wait: wait twice as long next time
            self._probing = False
        new = recovery.after_oom(old, self.rungs)
        if new is None:
            recovery.report(old, None, shapes, failure)
            raise NoFeasiblePlan(recovery.exhausted(failed, shapes, old), trials=tuple(failed))
        if new.rung != old.rung:
            self._open().switch(new.rung, recovery.host_share(new), new.sharding, self._drop_gradients)
        self.plan = new
        recovery.report(old, new, shapes, failure)
        self.recoveries.append(Recovery(step=self.steps_taken, failed=recovery.describe(old),
                                        micro_step=self._accumulator.micro_step, now=recovery.describe(new),
                                        shapes=shapes, note=failure, seconds=time.perf_counter() - started))
        log.warning("autotune: out of memory at %s (%s); re-running the same batch at %s x %d accumulation",
                    recovery.describe(old), failure, recovery.describe(new), new.accumulation_steps)

    def _balance(self, failure: str) -> None:
        """A 1-sample micro-batch failed on batch statistics: from now on none holds fewer than 2 (the same
        batch re-run with a balanced split). Not an OOM: nothing is reported."""
        self._too_few = False
        self.plan = recovery.balanced(self.plan, failure)
        log.warning("autotune: %s on a micro-batch of 1 sample; re-running the same batch with at least 2 samples "
                    "per micro-batch (%s x %d)", failure, self._config(), self.plan.accumulation_steps)

    def _maybe_grow(self) -> None:
        """After `grow_after` clean steps below the tuned micro-batch, try doubling it back."""
        if (not self.grow_after or self.plan.micro_batch_size >= self._grow_cap
                or self._clean_steps < self._grow_wait):
            return
        self.plan = recovery.grown(self.plan, self._grow_cap, self._clean_steps)
        self._probing = True
        self._clean_steps = 0
        log.info("autotune: trying micro-batch %d again after %d clean steps", self.plan.micro_batch_size,
                 self._grow_wait)

    def _config(self) -> str:
        return recovery.describe(self.plan)
