"""The offload rung: move what the GPU need not hold to host memory.

Two strengths:
- `activations`: with every block checkpointed, the one tensor each block keeps (its input) goes to
  pinned host memory in forward and comes back for the recompute in backward (`to_host` / `to_device`).
  Pays at long sequences; at short ones the copies cost more than they save (PEERS.md lesson 7).
- `optimizer`: FP32 master weights and the optimizer state live on the host and are updated there by a
  fused CPU optimizer; the GPU holds only 16-bit weights and gradients (`HostOptimizer`). For AdamW that
  takes the 16 bytes/parameter of FP32 weights + grads + two moments down to 4 (bf16 weights + grads).

On the simulated CPU device, host copies are made inside `host_memory()`, so the ceiling stops counting
them exactly as a GPU would.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..devices.ceiling import host_memory
from ..workload.optimizers import OptimizerSpec
from . import offload_partition
from .offload_partition import Gathered, Partition
from .offload_pipeline import OffloadPipeline, chunk_indices, optimizer_view, sync_view
from .offload_stream import DeviceStepper, cpu_share, flat_views, leading, stream_wanted, streamable


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    with host_memory():
        if t.device.type == "cpu":  # the simulated device: a separate copy, bookkept as host memory
            return t.detach().clone()
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t.detach(), non_blocking=True)
        return host


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter or gradient (a DTensor), viewing its storage; else `t`.

    Host copies are plain tensors: copying a DTensor into one raises "mixed torch.Tensor and DTensor",
    and each rank only ever updates its own shard.
    """
    return t.to_local() if isinstance(t, DTensor) else t


def to_host(x: torch.Tensor) -> torch.Tensor:
    """A detached copy of `x` in (pinned) host memory."""
    return _pinned_copy(x)


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A detached copy of host tensor `x` back on `device` (a counted copy on the simulated device)."""
    if device.type == "cpu":
        return x.detach().clone()
    return x.to(device, non_blocking=True)


NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def device_dtype(p: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter keeps on the device under optimizer offload: FP32 weights shrink to `dtype`
    (16 bits); any other dtype is the model's own choice and stays (a float64 model computes in float64,
    a bf16 model is 16-bit already, and a float64 input would not multiply a 16-bit weight)."""
    return dtype if p.dtype == torch.float32 else p.dtype


def master_dtype(p: torch.Tensor) -> torch.dtype:
    """The host master's dtype: FP32 for 16- and 32-bit weights (the point of a master copy), the
    parameter's own for float64 (or complex), which FP32 would round."""
    return _master_dtype_of(p.dtype)


def _master_dtype_of(dtype: torch.dtype) -> torch.dtype:
    """`master_dtype` for a parameter that had `dtype`."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16, torch.float32) else dtype


def norm_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the model's normalization layers (BatchNorm, InstanceNorm, LayerNorm, GroupNorm,
    RMSNorm): under optimizer offload they stay FP32 on the device."""
    return [p for m in model.modules() if isinstance(m, NORM_LAYERS) for p in m.parameters(recurse=False)]


def host_share(numels: Sequence[int], fraction: float) -> list[int]:
    """Positions of the parameters whose master and optimizer state go to the host: the last ones in model
    order, fewest whose elements reach `fraction` of the total (1.0: all of them, 0.0: none).

    The last parameters, because backward finishes their gradients first: the host gets the most time to
    step them behind the rest of backward, and the device steps the share whose gradients land last. The
    split is a function of the fraction alone, so a trial and the training step split alike.
    """
    last_first = list(reversed(range(len(numels))))
    return sorted(last_first[:leading(last_first, numels, fraction)])


def overlap_default() -> bool:
    """Whether optimizer offload overlaps with backward: on unless $AUTOTUNE_OFFLOAD_OVERLAP is 0 (the
    serial step, kept for comparison: benchmarks/bench_offload.py measures both)."""
    return os.environ.get("AUTOTUNE_OFFLOAD_OVERLAP", "1").strip() not in ("0", "false", "no", "off")


class HostOptimizer:
    """Optimizer offload: FP32 masters and state on the host, 16-bit weights and gradients on the device.

    `step()` copies the device gradients into FP32 host gradients, steps a CPU optimizer over the masters,
    and copies the updated masters back into the device weights (cast to 16 bits). `restore()` puts FP32
    weights back on the device and drops the host copies.

    With `overlap` (the default), the step's work starts during the last backward (`arm`, see
    offload_pipeline.py); without it, all of it runs in `step()`, as it first did. The two give the same
    parameters.

    `fraction` < 1 is partial offload (`plan.offload_fraction`): only that share of the parameters (the
    last in model order, `host_share`) has its master and state on the host; the rest keep FP32 weights
    on the device and are stepped there by a device optimizer of the same kind and hyperparameters.

    On replicated ranks each rank steps only its runs of both shares (`partition`, offload_partition.py):
    `host_index` and `device_index` are this rank's, `foreign` the other ranks', whose weights arrive after
    each step; `state_dict()` and `restore()` gather what the others hold.

    Parameters in `keep_fp32` (normalization layers': see `norm_parameters`) keep FP32 device weights:
    BatchNorm needs its weight in the dtype of its FP32 running statistics (cuDNN and the CPU kernel both
    refuse a 16-bit weight beside them), and norm weights are a negligible share of the memory.

    FSDP2-sharded parameters (DTensors) keep their FP32 shards too: FSDP casts them to 16 bits itself when
    it all-gathers (`MixedPrecisionPolicy`) and assigns FP32 reduced gradients to them, which a 16-bit
    shard refuses. Their masters copy this rank's shard only (`local_part`), so the host holds 1/world of
    the FP32 weights and optimizer state, and the device saves the optimizer state.
    """

    engaged = True  # an engine steps the optimizer (offload_engine.py)

    def __init__(self, params: Sequence[nn.Parameter], spec: OptimizerSpec, dtype: torch.dtype,
                 scaler: torch.amp.GradScaler | None = None, state: dict[str, Any] | None = None,
                 keep_fp32: Collection[nn.Parameter] = (), *, fraction: float = 1.0,
                 overlap: bool | None = None) -> None:
        self.params = list(params)
        self.spec = spec
        self.dtype = dtype
        self.dtypes = [p.dtype for p in self.params]  # each comes back in its own dtype (restore)
        self.scaler = scaler
        kept = {id(p) for p in keep_fp32} | {id(p) for p in self.params if isinstance(p, DTensor)}
        sharded = any(isinstance(p, DTensor) for p in self.params)
        numels = [p.numel() for p in self.params]
        host_all = host_share(numels, fraction)
        device_all = [i for i in range(len(self.params)) if i not in set(host_all)]
        self.fraction = sum(numels[i] for i in host_all) / max(1, sum(numels))
        # Replicated ranks each step their runs of both shares and send the weights (offload_partition.py).
        precision = "fp16" if dtype == torch.float16 else "bf16"
        self.partition = Partition([host_all, device_all], numels) if offload_partition.ranks(precision, sharded) > 1 else None
        mine = self.partition.mine if self.partition is not None else list
        self.host_index, self.device_index = mine(host_all), mine(device_all)
        host = set(self.host_index)
        self.foreign = sorted(set(range(len(self.params))) - host - set(self.device_index))  # other ranks step these
        self.gathered = Gathered()  # their state, when gathered (`gather`)
        self.gather_on_restore = False  # set by TrainingStep: restore() gathers the other ranks' weights and state
        self._kept = kept
        self._weights: dict[int, torch.Tensor] | None = None  # other ranks' weights, while a state dict is built
        with host_memory():
            self.master, self._flat = self._host_masters()
            slots = [self.master.get(i, p) for i, p in enumerate(self.params)]
            # None with no host share: `plan.offload_fraction` 0 on replicated ranks keeps every master on the
            # device, partitioned over the ranks (ZeRO-1 with 16-bit weights: offload_partition.py)
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
                    p.data = p.data.to(device_dtype(p, dtype))  # the device copy shrinks to 16 bits; its FP32 storage is freed
        self.param_groups = (self.optimizer or self.device_optimizer).param_groups
        # Gradient clipping (training/clipping.py) sets this before `step`: the host gradients are multiplied
        # by it after unscaling, in FP32, and it goes back to 1 after the step.
        self.grad_factor = 1.0
        self.skip: set[int] = set()  # positions already stepped for this batch by an aborted attempt
        self.pipeline: OffloadPipeline | None = None
        self._staging: dict[int, torch.Tensor] = {}  # CUDA only: pinned buffers in the device weights' dtype
        self._stream: Any = None
        self._views: dict[tuple[int, ...], torch.optim.Optimizer] = {}
        # Not over FSDP2 shards: FSDP assigns their reduced gradients on its own stream after each block's
        # reduce-scatter, not through the autograd accumulation the pipeline's hooks follow, and the overlapped
        # step's weight copies crashed there on two H200s (`CUDA error: invalid argument` sending a staged
        # shard back); the serial step copies each shard's master back in place.
        self.cpu_index: list[int] = []  # streamed: the leading part of the host share the CPU steps meanwhile
        self.stepper = self._make_stepper(sharded, numels)
        # `overlap` is the plan's (fit measured both ways); $AUTOTUNE_OFFLOAD_OVERLAP=0 turns it off regardless.
        # Streamed, no pipeline: the stepper overlaps on its own, from the hooks, and only where the plan says
        # so (`overlap` True; the pipeline's worker issuing the segments was no faster, RESULTS.md fourth
        # session). Partitioned, neither: a rank that ran out of memory in its worker or hooks would leave the
        # others waiting for its weights (the check-in guards the step, not the backward).
        self.stream_overlap = self.stepper is not None and overlap is True and overlap_default() and self.partition is None
        if self.stream_overlap:
            self.stepper.reserve()  # now, not in the first (timed) step: W1's share pins 8 GB more
        self._hooks: list[Any] = []
        if (overlap_default() and overlap is not False and self.host_index and not sharded and self.stepper is None
                and self.partition is None):
            self._start_pipeline()

    def _make_stepper(self, sharded: bool, numels: Sequence[int]) -> DeviceStepper | None:
        """The GPU steps the host share, its state streamed (offload_stream.py), where it can: on CUDA
        unless $AUTOTUNE_OFFLOAD_STREAM=0 (=1 also on the CPU test device), for Adam/AdamW over contiguous
        FP32 masters, without a GradScaler (its unscale and inf check run on the host gradients) or shards."""
        device = self.params[0].device if self.params else torch.device("cpu")
        if not stream_wanted(device.type) or self._flat is None or self.scaler is not None or sharded or streamable(self.optimizer):
            return None
        if not all(self.params[i].is_contiguous() for i in self.host_index):
            return None
        # The CPU steps the first of the host share (backward finishes their gradients last, so the GPU gets
        # the ones it can start on during the last backward); their masters lead the flat buffer.
        self.cpu_index = self.host_index[:leading(self.host_index, numels, cpu_share())]
        streamed = self.host_index[len(self.cpu_index):]
        if not streamed:
            self.cpu_index = []
            return None
        offset = sum(numels[i] for i in self.cpu_index)
        return DeviceStepper(self.optimizer, self._flat[offset:], self.master, streamed, self.params, device)

    @property
    def streamed_index(self) -> list[int]:
        """The host share's positions the device steps (`stepper`); the CPU steps `cpu_index`."""
        return self.host_index[len(self.cpu_index):] if self.stepper is not None else []

    @property
    def masters(self) -> list[torch.Tensor]:
        """The FP32 host masters, in the order of `host_index` (every parameter's, under full offload)."""
        return [self.master[i] for i in self.host_index]

    def _host_masters(self) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """The host share's masters: where every one is FP32 and none is a shard, views of one pinned
        buffer in `host_index` order (the device stepper streams ranges of it), with that buffer; else
        one tensor each, and None."""
        share = [self.params[i] for i in self.host_index]
        if not share or any(master_dtype(p) != torch.float32 or isinstance(p, DTensor) for p in share):
            return {i: self._host_master(self.params[i]) for i in self.host_index}, None
        cuda = share[0].device.type == "cuda"
        flat, views = flat_views([p.shape for p in share], pin=cuda)
        for p, master in zip(share, views):
            master.copy_(p.detach())
            master.grad = torch.zeros_like(master, pin_memory=cuda)
        return dict(zip(self.host_index, views)), flat

    @staticmethod
    def _host_master(p: nn.Parameter) -> torch.Tensor:
        fp = master_dtype(p)
        weight = local_part(p.detach())
        master = _pinned_copy(weight.to(fp)) if p.device.type != "cpu" else weight.to(fp, copy=True)
        master.grad = torch.zeros_like(master, pin_memory=p.device.type != "cpu")
        return master

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

    def _stage(self, i: int, grad: torch.Tensor) -> None:
        self._staging[i].copy_(local_part(grad), non_blocking=True)  # on the side stream, in the hook (see the pipeline)

    def _land(self, i: int) -> None:
        source = self._staging[i] if self._staging else local_part(self.params[i].grad)
        self.master[i].grad.copy_(source)

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
            view.step()

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

    def _copy_grads(self, indices: Sequence[int]) -> None:
        """The device gradients at `indices` into their FP32 host masters' (host-side copies: on the
        simulated device, not device memory)."""
        with host_memory():
            for i in indices:
                grad = self.params[i].grad
                if grad is None:
                    self.master[i].grad.zero_()
                else:
                    self.master[i].grad.copy_(local_part(grad), non_blocking=True)

    def _update(self, stepped: set[int]) -> None:
        """Unscale and clip what was not stepped yet, step it, and bring every host weight back."""
        factor, self.grad_factor = self.grad_factor, 1.0
        device_grads = self._device_grads()
        try:
            if self.scaler is not None and not self._unscale(device_grads):
                return  # non-finite gradients: skip this step, as GradScaler.step would
            rest = [i for i in self.host_index if i not in stepped]
            if factor != 1.0:  # streamed, the stepper multiplies the device gradients as it widens them
                host = [] if self.stepper is not None else [self.master[i].grad for i in rest]
                for g in host + device_grads:
                    g.mul_(factor)
            self._step_device()  # queued on the device, while the host steps its share
        finally:
            for master in self.device_master.values():
                if master is not None and not isinstance(master, nn.Parameter):
                    master.grad = None  # an FP32 copy made for the step: freed before the next forward
        self._step_host_share(stepped, rest, factor)

    def _device_grads(self) -> list[torch.Tensor]:
        """FP32 gradients of the device share, on its masters (a temporary copy of each 16-bit gradient)."""
        grads = []
        for i, master in self.device_master.items():
            p = self.params[i]
            if master is not p:
                master.grad = p.grad.to(master.dtype) if p.grad is not None else torch.zeros_like(master)
            elif p.grad is None:
                p.grad = torch.zeros_like(p)  # stepped with a zero gradient, as the host share is
            grads.append(master.grad)
        return grads

    def _step_device(self) -> None:
        if self.device_optimizer is None:
            return
        self.device_optimizer.step()
        for i, master in self.device_master.items():
            if master is not self.params[i]:
                self.params[i].data.copy_(master)

    def _step_host_share(self, stepped: set[int], rest: list[int], factor: float) -> None:
        if not self.host_index:  # every master on the device (partitioned over the ranks): nothing to do here
            return
        if self.pipeline is None and not stepped:  # the serial step, as it always was
            if self.stepper is not None:
                self._step_streamed(factor)
                return
            with host_memory():
                self.optimizer.step()
            self._write_back(self.host_index)
            return
        staged = {i for c in self.pipeline.done for i in self.pipeline.chunks[c]} if self.pipeline else set()
        self._send_back(sorted(staged))  # narrowed by the worker during backward
        self._write_back(sorted(stepped - staged))  # stepped by an earlier attempt of this batch
        for chunk in self.pipeline.chunks if self.pipeline else [rest]:
            todo = [i for i in chunk if i not in stepped]
            if todo:
                self._step_host(todo)
                self._write_back(todo)
        if self._stream is not None:
            torch.cuda.current_stream(self.params[0].device).wait_stream(self._stream)  # the next forward waits

    def _step_streamed(self, factor: float) -> None:
        """The device steps its part of the host share (overlapped: issues what the last backward left) while
        the CPU steps `cpu_index`: their gradients out first, ahead of the stepper's traffic on the link,
        then the CPU's step, its weights sent back; then the stepper is waited for."""
        grads_out = self._cpu_grads_out()
        armed = self.stepper.armed
        if armed:
            self._disarm(failed=False)
            self.stepper.issue_rest()
        else:
            self.stepper.step(self.streamed_index, factor=factor)
        if self.cpu_index:
            if grads_out is not None:
                grads_out.synchronize()  # this part's gradients only: the stepper's streams run on
            if factor != 1.0:
                for i in self.cpu_index:
                    self.master[i].grad.mul_(factor)
            self._step_host(self.cpu_index)
            self._write_back(self.cpu_index)
        if armed:
            self.stepper.finish()
        else:
            self.stepper.wait()

    def _cpu_grads_out(self) -> Any:
        """The CPU part's gradients to their host masters, on the current stream; an event after them (None
        on the CPU test device, or with no CPU part)."""
        if not self.cpu_index:
            return None
        self._copy_grads(self.cpu_index)
        if self.params[0].device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.params[0].device))
        return event

    def _write_back(self, indices: Sequence[int]) -> None:
        """Updated masters into the device weights (narrowed to their dtype)."""
        if self._staging:
            for i in indices:
                self._staging[i].copy_(self.master[i])  # narrowed on the CPU: 2 bytes a parameter cross PCIe
            self._send_back(indices)
            return
        for i in indices:
            local_part(self.params[i].data).copy_(self.master[i], non_blocking=True)

    def _send_back(self, indices: Sequence[int]) -> None:
        """Staged weights host to device on the side stream (the simulated device has no staging)."""
        if not self._staging:
            self._write_back(indices)
            return
        with torch.cuda.stream(self._stream):
            for i in indices:
                local_part(self.params[i].data).copy_(self._staging[i], non_blocking=True)

    def _unscale(self, device: list[torch.Tensor]) -> bool:
        """FP16 only: divide the gradients by the loss scale; False (and a smaller scale) on inf/NaN."""
        scale = float(self.scaler.get_scale())
        host = [self.master[i].grad for i in self.host_index]
        finite = all(math.isfinite(float(g.abs().max())) for g in host + device if g.numel())
        if finite:
            for g in host + device:
                g.div_(scale)
            self.scaler.update(scale)
        else:
            self.scaler.update(scale * self.scaler.get_backoff_factor())
        return finite

    def _restore_foreign(self) -> None:
        """The FP32 weights of the parameters other ranks stepped: gathered from them where the ranks agreed
        to (`gather_on_restore`: TrainingStep, whose ranks close alike); in a trial, where a rank that ran out
        of memory building its optimizer restores nothing, their 16-bit weights widened (the search puts the
        model's own weights back when it ends)."""
        if self.gather_on_restore:
            current = [i for i, p in enumerate(self.params) if id(p) in self._kept]
            self.partition.gather_weights(self.params, self.dtypes, current)
            return
        for i in self.foreign:
            if id(self.params[i]) in self._kept:
                continue
            self.params[i].data = self.params[i].data.to(self.dtypes[i])

    # -- the weights training uses, for the model's state dict -------------------------------------------
    def holds_weight(self, i: int) -> bool:
        """Whether position i's full-precision weight lives apart from its device parameter: a master here
        (host or device share) or on the rank that steps it. Kept FP32 parameters are their own masters."""
        if id(self.params[i]) in self._kept:
            return False
        return i in self.master or i in self.device_master or i in self.foreign

    def weight(self, i: int) -> torch.Tensor:
        """Position i's full-precision weight (see `holds_weight`), detached.

        A host master is returned as a copy with its own storage: the masters are views of one pinned buffer
        (which a safetensors save would refuse as shared memory) and an overlapped step re-points them. Under
        the partitioned state another rank's weight is gathered (`gather_weights`), a collective.
        """
        if i in self.master:
            with host_memory():
                return self.master[i].detach().clone()
        if i in self.device_master:
            return self.device_master[i].detach()
        self.gather_weights()
        assert self._weights is not None
        return self._weights[i]

    def gather_weights(self) -> None:
        """Partitioned: the other ranks' full-precision weights, once until `forget_weights` (a collective)."""
        if self._weights is None and self.partition is not None:
            self._weights = self._gather_foreign()

    def _gather_foreign(self) -> dict[int, torch.Tensor]:
        """The full-precision weights other ranks hold the masters of, as host tensors: every rank sends its
        own and receives the rest (a collective, in the same order on every rank)."""
        assert self.partition is not None
        own = {**{i: m for i, m in self.device_master.items() if m is not self.params[i]}, **self.master}
        shapes = [p.shape for p in self.params]
        dtypes = [_master_dtype_of(d) for d in self.dtypes]
        kept = [i for i, p in enumerate(self.params) if id(p) in self._kept]
        with host_memory():
            return self.partition.gather_masters(own, shapes, dtypes, skip=kept)

    def forget_weights(self) -> None:
        """Drop the other ranks' weights gathered for a state dict (host memory held only while it is built)."""
        self._weights = None

    def has_master(self, i: int) -> bool:
        """Whether this rank keeps a master of position i that the step writes back into the parameter (a
        kept FP32 parameter may have one too: the host steps it)."""
        return i in self.master or (i in self.device_master and self.device_master[i] is not self.params[i])

    @torch.no_grad()
    def load_weight(self, i: int, value: torch.Tensor) -> None:
        """Position i's full-precision weight from a checkpoint: into its master, so the next step trains from
        it unrounded (the device's 16-bit copy is loaded by torch itself). Another rank's master is loaded there."""
        value = local_part(value.detach())
        if i in self.master:
            with host_memory():
                self.master[i].copy_(value)
        elif self.has_master(i):
            self.device_master[i].copy_(value)

    # -- state, in the layout of the user's optimizer -----------------------------------------------------
    def owners(self) -> list[tuple[torch.optim.Optimizer, torch.Tensor]]:
        """(optimizer, state key) of each trainable parameter in the order of the user's groups: position
        k of the user's `state_dict()["state"]`. The key is the host master, or the parameter itself for
        the share stepped on the device."""
        out: list[tuple[Any, torch.Tensor]] = []
        for i in self.spec.order():
            if i in self.master:
                out.append((self.optimizer, self.master[i]))
            elif i in self.device_master:
                out.append((self.device_optimizer, self.device_master[i]))
            else:  # stepped by another rank: its state once gathered (`gather`)
                out.append((self.gathered, self.params[i]))
        return out

    def gather(self) -> None:
        """Partitioned: the state of the parameters other ranks step, into `self.gathered`. A collective:
        every rank must call it (`state_dict()` does). A no-op on one rank, or once restored."""
        if self.partition is None or (self.optimizer is None and self.device_optimizer is None):  # restored
            return
        states = {i: opt.state[key] for i, (opt, key) in zip(self.spec.order(), self.owners())
                  if opt is not self.gathered and opt.state.get(key)}
        self.partition.gather_state(states, self.params, self.gathered)

    def state_dict(self) -> dict[str, Any]:
        """The state of both shares, keyed as the user's optimizer keys it (partitioned: gathered from every
        rank, so every rank must call it)."""
        self.gather()
        sd = (self.optimizer or self.device_optimizer).state_dict()
        sd["state"] = {k: opt.state[key] for k, (opt, key) in enumerate(self.owners()) if opt.state.get(key)}
        return sd

    def load_user_state(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of the user's layout into the host and device shares (each cast to where it lives)."""
        state = state_dict.get("state", {})
        order = self.spec.order()
        for opt, share in ((self.optimizer, set(self.host_index)), (self.device_optimizer, set(self.device_index))):
            if opt is None:
                continue
            positions = [k for k, i in enumerate(order) if i in share]
            part = opt.state_dict()
            part["state"] = {n: state[k] for n, k in enumerate(positions) if k in state}
            if opt is self.optimizer:  # the host masters are plain tensors: a shard's state as its local part
                part["state"] = {n: {name: local_part(v) if isinstance(v, torch.Tensor) else v
                                     for name, v in entry.items()} for n, entry in part["state"].items()}
            with host_memory() if opt is self.optimizer else contextlib.nullcontext():
                opt.load_state_dict(part)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The inverse of `state_dict()`: a state dict of the user's layout."""
        self.load_user_state(state_dict)

    def sync_hyperparameters(self, groups: Sequence[dict[str, Any]], skip: Collection[str]) -> None:
        """Copy lr, betas, weight decay... from the user's groups (one per spec group) into both shares."""
        for opt, share in ((self.optimizer, self.host_index), (self.device_optimizer, self.device_index)):
            if opt is None:
                continue
            for j, theirs in zip(self.spec.group_indices(share), opt.param_groups):
                for key, value in groups[j].items():
                    if key not in skip and key in theirs:
                        theirs[key] = value

    @torch.no_grad()
    def restore(self) -> None:
        """Undo the offload: the weights back on the device in the dtype they came in, host copies released."""
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        self._disarm(failed=True)  # an armed backward that never reached the step (a trial's OOM)
        if self.stepper is not None:
            self.stepper.close()  # nothing may still read the device gradients or write its buffers once freed
        if self.gather_on_restore:
            self.gather()  # before the state goes: the user's optimizer gets every rank's back
        for i, master in [*self.master.items(), *self.device_master.items()]:
            p = self.params[i]
            if master is not p and not isinstance(p, DTensor):  # a shard's FP32 storage was updated in place
                p.data = master.detach().to(p.device, dtype=self.dtypes[i], copy=True)
        if self.partition is not None:  # the weights other ranks held the masters of (norm weights are current)
            self._restore_foreign()
        for p in self.params:
            p.grad = None
        self.master = {}
        self.device_master = {}
        self._staging = {}
        self._views = {}
        self._flat = None
        self.stepper = None
        self.cpu_index = []
        self.optimizer = None  # type: ignore[assignment]
        self.device_optimizer = None
