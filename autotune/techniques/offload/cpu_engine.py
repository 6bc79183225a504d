"""The CPU engine of optimizer offload: FP32 masters and optimizer state on the host, stepped by a fused CPU
optimizer (during the last backward by a worker thread, `pipeline.py`), or by the GPU with the state streamed
(`streamed.py`); partitioned over replicated ranks (`partition.py`). Its state dict and weights, as the
user's optimizer and model read them, are in `engine_state.py`; its copies between device and host in
`host_copies.py`."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any, cast

import torch
from torch import nn

from ...devices.ceiling import host_memory
from ...devices.shards import is_shard
from ...workload.optimizers import OptimizerSpec
from . import partition as offload_partition
from .engine_state import EngineState
from .host_copies import HostCopies
from .partition import Gathered, Partition
from .pipeline import OffloadPipeline, chunk_indices, momentum_apart, optimizer_view, sync_view
from .streamed import DeviceStepper, stream_wanted, streamable
from .tensors import device_dtype, give_gradients, host_masters, host_share, local_part, master_dtype, overlap_default


class HostOptimizer(HostCopies, EngineState):
    """Optimizer offload: FP32 masters and state on the host, 16-bit weights and gradients on the device.

    `step()` copies the device gradients into FP32 host gradients, steps a CPU optimizer over the masters,
    and copies the updated masters back into the device weights (cast to 16 bits). `restore()` puts FP32
    weights back on the device and drops the host copies.

    With `overlap` (the default), the step's work starts during the last backward (`arm`, see
    pipeline.py); without it, all of it runs in `step()`. The two give the same parameters.

    Every share steps as torch's optimizer would: a parameter whose gradient is None after backward (a head
    or expert this batch did not use) is not stepped, so it gets no weight decay, no moment update and no
    step count, and keeps no state before its first gradient (each master's `.grad` is its FP32 buffer only
    in a step where its parameter got a gradient).

    `fraction` < 1 is partial offload (`plan.offload_fraction`): only that share of the parameters (the
    last in model order, `host_share`) has its master and state on the host; the rest keep FP32 weights
    on the device and are stepped there by a device optimizer of the same kind and hyperparameters.

    On replicated ranks each rank steps only its runs of both shares (`partition`, partition.py):
    `host_index` and `device_index` are this rank's, `foreign` the other ranks', whose weights arrive after
    each step; `state_dict()` and `restore()` gather what the others hold.

    Parameters in `keep_fp32` (normalization layers': see `norm_parameters`) keep FP32 device weights:
    BatchNorm needs its weight in the dtype of its FP32 running statistics (cuDNN and the CPU kernel both
    refuse a 16-bit weight beside them), and norm weights are a negligible share of the memory.

    FSDP2-sharded parameters (DTensors) keep their FP32 shards too: FSDP casts them to 16 bits itself when
    it all-gathers (`MixedPrecisionPolicy`) and assigns FP32 reduced gradients to them, which a 16-bit
    shard refuses. Their masters copy this rank's shard only (`local_part`), so the host holds 1/world of
    the FP32 weights and optimizer state, and the device saves the optimizer state.

    Large: the count takes in its two mixins (engine_state.py, host_copies.py), which hold no state of their
    own. What stays together is one set of parameters seen from both sides: the device weights, the host
    masters with their gradient and staging buffers, the host and device shares with their two optimizers,
    this rank's part of a partition, and the pipeline or stepper that runs the step. The serial, overlapped
    and streamed steps, `restore()` and `state_dict()` all index those same per-parameter buffers by position;
    splitting the modes into engines of their own, each owning its buffers, is the way to make it smaller.
    """

    engaged = True  # an engine steps the optimizer (interface.py)

    def __init__(self, params: Sequence[nn.Parameter], spec: OptimizerSpec, dtype: torch.dtype,
                 scaler: torch.amp.GradScaler | None = None, state: dict[str, Any] | None = None,
                 keep_fp32: Collection[nn.Parameter] = (), *, fraction: float = 1.0,
                 overlap: bool | None = None) -> None:
        self.params = list(params)
        self.spec = spec
        self.dtype = dtype
        self.dtypes = [p.dtype for p in self.params]  # each comes back in its own dtype (restore)
        self.scaler = scaler
        kept = {id(p) for p in keep_fp32} | {id(p) for p in self.params if is_shard(p)}
        sharded = any(is_shard(p) for p in self.params)
        numels = [p.numel() for p in self.params]
        host_all = host_share(numels, fraction)
        device_all = [i for i in range(len(self.params)) if i not in set(host_all)]
        self.fraction = sum(numels[i] for i in host_all) / max(1, sum(numels))
        # Replicated ranks each step their runs of both shares and send the weights (partition.py).
        precision = "fp16" if dtype == torch.float16 else "bf16"
        self.partition = (Partition([host_all, device_all], numels)
                          if offload_partition.ranks(precision, sharded) > 1 else None)
        mine = self.partition.mine if self.partition is not None else list
        self.host_index, self.device_index = mine(host_all), mine(device_all)
        host = set(self.host_index)
        self.foreign = sorted(set(range(len(self.params))) - host - set(self.device_index))  # other ranks step these
        self.gathered = Gathered()  # their state, when gathered (`gather`)
        self.gather_on_restore = False  # set by TrainingStep: restore() gathers the other ranks' weights and state
        self._kept = kept
        self._weights: dict[int, torch.Tensor] | None = None  # other ranks' weights, while a state dict is built
        with host_memory():
            self.master, self._flat = host_masters(self.params, self.host_index)
            slots = [self.master.get(i, p) for i, p in enumerate(self.params)]
            # None with no host share: the optimizer state sharded over replicated ranks keeps every master
            # on the device, partitioned over the ranks (ZeRO-1 with 16-bit weights: partition.py)
            self.optimizer = spec.build(slots, host=True, only=host) if host else None
        # The device share: FP32 masters on the device beside the same 16-bit weights (norm weights, FP32
        # already, are their own masters), so forward computes in the same dtypes as under full offload.
        self.device_master = {i: self.params[i] if id(self.params[i]) in kept
                              else self.params[i].detach().to(master_dtype(self.params[i]), copy=True)
                              for i in self.device_index}
        slots = [self.device_master.get(i, p) for i, p in enumerate(self.params)]
        self.device_optimizer = spec.build(slots, only=self.device_index) if self.device_index else None
        if state is not None:
            self.load_user_state(state)
        with torch.no_grad():
            for p in self.params:
                if id(p) not in kept:
                    # the device copy shrinks to 16 bits; its FP32 storage is freed
                    p.data = p.data.to(device_dtype(p, dtype))
        self.param_groups = (self.optimizer or self.device_optimizer).param_groups
        # Gradient clipping (training/clipping.py) sets this before `step`: the host gradients are multiplied
        # by it after unscaling, in FP32, and it goes back to 1 after the step.
        self.grad_factor = 1.0
        self.skip: set[int] = set()  # positions already stepped for this batch by an aborted attempt
        self.pipeline: OffloadPipeline | None = None
        self._staging: dict[int, torch.Tensor] = {}  # CUDA only: pinned buffers in the device weights' dtype
        self._stream: Any = None
        self._views: dict[tuple[int, ...], torch.optim.Optimizer] = {}
        # Over FSDP2 shards, serial only: FSDP assigns their reduced gradients on its own stream after each
        # block's reduce-scatter, not through the autograd accumulation the overlapping hooks follow, and
        # sending a staged shard back fails there; the serial step writes each shard's master back in place.
        self.stepper = self._make_stepper()
        if self.stepper is None:  # the CPU step reads FP32 host gradients; the streamed one, the device's
            give_gradients(self.master)
        # Each host master's FP32 gradient buffer, kept here: the master's `.grad` is this buffer in a step where
        # its device gradient exists and None where it does not, so the CPU optimizer skips it as torch would.
        self._grads = {i: m.grad for i, m in self.master.items() if m.grad is not None}
        # `overlap` is the plan's (fit measured both ways); $AUTOTUNE_OFFLOAD_OVERLAP=0 turns it off regardless.
        # Streamed, no pipeline: the stepper overlaps on its own, from the hooks, and only where the plan says
        # so (the pipeline's worker issuing the segments was no faster). Partitioned, neither: a rank that ran
        # out of memory in its worker or hooks would leave the others waiting for its weights (the check-in
        # guards the step, not the backward).
        self.stream_overlap = (self.stepper is not None and overlap is True and overlap_default()
                               and self.partition is None and not sharded)
        if self.stream_overlap:
            self.stepper.reserve()  # now, not in the first (timed) step: its second set of buffers is large
        self._hooks: list[Any] = []
        if (overlap_default() and overlap is not False and self.host_index and not sharded and self.stepper is None
                and self.partition is None):
            self._start_pipeline()

    def _make_stepper(self) -> DeviceStepper | None:
        """The GPU steps the host share, its state streamed (streamed.py), where it can: on CUDA
        unless $AUTOTUNE_OFFLOAD_STREAM=0 (=1 also on the CPU test device), for Adam/AdamW over contiguous
        masters of one dtype (of FSDP2 shards, this rank's parts), without a GradScaler (its unscale and inf
        check run on the host gradients)."""
        device = self.params[0].device if self.params else torch.device("cpu")
        if (not stream_wanted(device.type) or self._flat is None or self.scaler is not None
                or streamable(self.optimizer)):
            return None
        if not all(local_part(self.params[i]).is_contiguous() for i in self.host_index):
            return None
        return DeviceStepper(self.optimizer, self._flat, self.master, self.host_index, self.params, device)

    @property
    def streamed_index(self) -> list[int]:
        """The host share's positions the device steps (`stepper`): all of them, where it streams."""
        return self.host_index if self.stepper is not None else []

    @property
    def masters(self) -> list[torch.Tensor]:
        """The FP32 host masters, in the order of `host_index` (every parameter's, under full offload)."""
        return [self.master[i] for i in self.host_index]

    # -- the overlapped step ----------------------------------------------------------------------------
    def _start_pipeline(self) -> None:
        cuda = self.params[0].device.type == "cuda"
        stream = torch.cuda.Stream(self.params[0].device) if cuda else None
        if cuda:  # one pinned buffer per parameter in the device weight's dtype: gradient out, weight back
            self._staging = {i: torch.empty(self.master[i].shape, dtype=self.params[i].dtype, pin_memory=True)
                             for i in self.host_index}
        numels = [p.numel() for p in self.params]
        self.pipeline = OffloadPipeline({i: self.params[i] for i in self.host_index},
                                        chunk_indices(self.host_index, numels), self._land, self._step_chunk,
                                        stream=stream, stage=self._stage if cuda else None)
        self._stream = stream

    def arm(self, defer: bool = False) -> None:
        """The next backward is the last before `step()`: start the host's work during it.

        `defer=True` when a gradient may still change after backward (clipping, loss scaling, a callback):
        the copies overlap backward, the CPU steps wait for `step()`. A no-op without the pipeline.
        """
        if self.pipeline is not None:
            self.pipeline.arm(defer or self.scaler is not None)
        elif self.stream_overlap and not defer and self.host_index:  # streamed: segments issued as gradients land
            self.stepper.begin(self.streamed_index)
            self._hooks = [self.params[i].register_post_accumulate_grad_hook(lambda p, i=i: self.stepper.landed(i))
                           for i in self.streamed_index]

    def _disarm(self, *, failed: bool) -> None:
        """Streamed overlap: remove the hooks; after a failed backward, undo what was issued (see the stepper)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if failed and self.stepper is not None and self.stepper.armed:
            self.stepper.abort()

    def abort(self) -> set[int]:
        """The armed attempt ran out of memory and will be re-run: chunks already stepped are not stepped
        again (their weights, still old on the device, go back with the re-run's step); their positions.
        Streamed, nothing was stepped for good: the weights go back and the re-run steps everything."""
        self._disarm(failed=True)
        if self.pipeline is not None:
            self.pipeline.abort()
            self.skip |= {i for c in self.pipeline.done for i in self.pipeline.chunks[c]}
        return set(self.skip)

    def keep_stepped(self, positions: set[int]) -> set[int]:
        """After a rung switch: these positions keep the update an aborted attempt gave them (not stepped
        twice; the re-run sees their new weights). The ones this engine steps."""
        self.skip = positions & set(self.host_index)
        return self.skip

    def scale_gradients(self, factor: float) -> None:
        """Clipping's factor: the FP32 host gradients are multiplied by it after unscaling, for the next step."""
        self.grad_factor = factor

    def for_training(self) -> None:
        """`restore()` hands every rank's weights and state back (partitioned over ranks)."""
        self.gather_on_restore = True

    def _has_grad(self, i: int) -> bool:
        """Whether position i got a gradient in this step: torch's optimizers step only those (no weight decay,
        moment update or step count for the others), and so does every share of this engine."""
        return self.params[i].grad is not None

    def _step_chunk(self, indices: list[int]) -> None:
        self._step_host(indices)
        for i in indices:
            if self._staging:
                self._staging[i].copy_(self.master[i])  # narrowed on the CPU; sent back after backward

    def _step_host(self, indices: Sequence[int]) -> None:
        key = tuple(indices)
        view = self._views.get(key)
        if view is None:
            view = self._views.setdefault(key, optimizer_view(self.optimizer, [self.master[i] for i in indices]))
        sync_view(view)
        with host_memory():
            for part in momentum_apart(view):
                part.step()

    # -- the step ----------------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        self._weights = None  # gathered for a state dict before this step: stale after it
        pipeline = self.pipeline
        if pipeline is not None and pipeline.armed:
            try:
                pipeline.finish()
            except BaseException:
                pipeline.reset()
                raise
        landed = pipeline.landed - pipeline.refired if pipeline is not None else set()
        done = {i for c in pipeline.done for i in pipeline.chunks[c]} if pipeline is not None else set()
        if self.stepper is None:  # streamed, the stepper reads the device gradients itself
            self._copy_grads([i for i in self.host_index if i not in landed and i not in done and i not in self.skip])
        if self.params[0].device.type == "cuda" and self.stepper is None and self.host_index:
            torch.cuda.synchronize(self.params[0].device)  # the host gradients' copies have landed
        try:
            self._update(done | self.skip)
            if self.partition is not None:
                self.partition.share_weights(self.params)  # every rank's updated weights to every other rank
        except BaseException:
            self._disarm(failed=True)  # overlapped and not finished: the old weights back, the state untouched
            if self.stepper is not None:
                self.stepper.close()  # a step failed half-way: no copy may still run into buffers freed next
            raise
        finally:
            self.skip = set()
            if pipeline is not None:
                pipeline.reset()

    def _update(self, stepped: set[int]) -> None:
        """Unscale and clip what was not stepped yet, step it, and bring every host weight back."""
        factor, self.grad_factor = self.grad_factor, 1.0
        device_grads = self._device_grads()
        try:
            if self.scaler is not None and not self._unscale(device_grads):
                return  # non-finite gradients: skip this step, as GradScaler.step would
            rest = [i for i in self.host_index if i not in stepped]
            if factor != 1.0:  # streamed, the stepper multiplies the device gradients as it widens them
                host = [] if self.stepper is not None else self._live_host_grads(rest)
                for g in host + device_grads:
                    g.mul_(factor)
            self._step_device()  # queued on the device, while the host steps its share
        finally:
            for master in self.device_master.values():
                if master is not None and not isinstance(master, nn.Parameter):
                    master.grad = None  # an FP32 copy made for the step: freed before the next forward
        self._step_host_share(stepped, rest, factor)

    def _device_grads(self) -> list[torch.Tensor]:
        """FP32 gradients of the device share, on its masters (a temporary copy of each 16-bit gradient); a
        parameter that got none keeps none, and the device optimizer skips it."""
        grads = []
        for i, master in self.device_master.items():
            p = self.params[i]
            if p.grad is None:
                continue
            if master is not p:
                master.grad = p.grad.to(master.dtype)
            grads.append(cast(torch.Tensor, master.grad))
        return grads

    def _step_device(self) -> None:
        if self.device_optimizer is None:
            return
        self.device_optimizer.step()
        for i, master in self.device_master.items():
            if master is not self.params[i] and master.grad is not None:  # stepped: its new weight to the device
                self.params[i].data.copy_(master)

    def _step_host_share(self, stepped: set[int], rest: list[int], factor: float) -> None:
        if not self.host_index:  # every master on the device (partitioned over the ranks): nothing to do here
            return
        if self.pipeline is None and not stepped:  # the serial step, as it always was
            if self.stepper is not None:
                self._step_streamed(factor)
                return
            with host_memory():
                for part in momentum_apart(self.optimizer):
                    part.step()
            self._write_back([i for i in self.host_index if self.master[i].grad is not None])
            return
        staged = {i for c in self.pipeline.done for i in self.pipeline.chunks[c]} if self.pipeline else set()
        self._send_back(sorted(staged))  # narrowed by the worker during backward
        self._write_back(sorted(stepped - staged))  # stepped by an earlier attempt of this batch
        for chunk in self.pipeline.chunks if self.pipeline else [rest]:
            todo = [i for i in chunk if i not in stepped]
            if todo:  # (a master without a gradient this step is in the view, and skipped by its optimizer)
                self._step_host(todo)
                self._write_back([i for i in todo if self.master[i].grad is not None])
        if self._stream is not None:
            torch.cuda.current_stream(self.params[0].device).wait_stream(self._stream)  # the next forward waits

    def _step_streamed(self, factor: float) -> None:
        """The device steps the host share (overlapped: issues what the last backward left), then is waited for."""
        if self.stepper.armed:
            self._disarm(failed=False)
            self.stepper.issue_rest()
            self.stepper.finish()
        else:
            self.stepper.step(self.streamed_index, factor=factor)
            self.stepper.wait()

    def _unscale(self, device: list[torch.Tensor]) -> bool:
        """FP16 only: divide the gradients by the loss scale; False (and a smaller scale) on inf/NaN."""
        scaler = self.scaler
        assert scaler is not None, "unscaling without a loss scaler"
        scale = float(scaler.get_scale())
        host = self._live_host_grads(self.host_index)
        finite = all(math.isfinite(float(g.abs().max())) for g in host + device if g.numel())
        if finite:
            for g in host + device:
                g.div_(scale)
            scaler.update(scale)
        else:
            scaler.update(scale * scaler.get_backoff_factor())
        return finite
