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

import math
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn

from ..devices.ceiling import host_memory
from ..workload.optimizers import OptimizerSpec


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    with host_memory():
        if t.device.type == "cpu":  # the simulated device: a separate copy, bookkept as host memory
            return t.detach().clone()
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t.detach(), non_blocking=True)
        return host


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
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16, torch.float32) else p.dtype


def norm_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the model's normalization layers (BatchNorm, InstanceNorm, LayerNorm, GroupNorm,
    RMSNorm): under optimizer offload they stay FP32 on the device."""
    return [p for m in model.modules() if isinstance(m, NORM_LAYERS) for p in m.parameters(recurse=False)]


class HostOptimizer:
    """Optimizer offload: FP32 masters and state on the host, 16-bit weights and gradients on the device.

    `step()` copies the device gradients into pinned FP32 host buffers, steps a CPU optimizer over the
    masters, and copies the updated masters back into the device weights (cast to 16 bits). `restore()`
    puts FP32 weights back on the device and drops the host copies.

    Parameters in `keep_fp32` (normalization layers': see `norm_parameters`) keep FP32 device weights:
    BatchNorm needs its weight in the dtype of its FP32 running statistics (cuDNN and the CPU kernel both
    refuse a 16-bit weight beside them), and norm weights are a negligible share of the memory.
    """

    def __init__(self, params: Sequence[nn.Parameter], spec: OptimizerSpec, dtype: torch.dtype,
                 scaler: torch.amp.GradScaler | None = None, state: dict[str, Any] | None = None,
                 keep_fp32: Collection[nn.Parameter] = ()) -> None:
        self.params = list(params)
        self.dtype = dtype
        self.dtypes = [p.dtype for p in self.params]  # each comes back in its own dtype (restore)
        self.scaler = scaler
        kept = {id(p) for p in keep_fp32}
        with host_memory():
            self.masters = [self._host_master(p) for p in self.params]
            self.optimizer = spec.build(self.masters, host=True)
            if state is not None:
                self.optimizer.load_state_dict(state)
        with torch.no_grad():
            for p in self.params:
                if id(p) not in kept:
                    p.data = p.data.to(device_dtype(p, dtype))  # the device copy shrinks to 16 bits; its FP32 storage is freed
        self.param_groups = self.optimizer.param_groups
        # Gradient clipping (training/clipping.py) sets this before `step`: the host gradients are multiplied
        # by it after unscaling, in FP32, and it goes back to 1 after the step.
        self.grad_factor = 1.0

    @staticmethod
    def _host_master(p: nn.Parameter) -> torch.Tensor:
        fp = master_dtype(p)
        master = _pinned_copy(p.data.to(fp)) if p.device.type != "cpu" else p.data.detach().to(fp, copy=True)
        master.grad = torch.zeros_like(master, pin_memory=p.device.type != "cpu")
        return master

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for p, master in zip(self.params, self.masters):
            if p.grad is None:
                master.grad.zero_()
            else:
                master.grad.copy_(p.grad, non_blocking=True)
        if self.params and self.params[0].device.type == "cuda":
            torch.cuda.synchronize(self.params[0].device)
        factor, self.grad_factor = self.grad_factor, 1.0
        if self.scaler is not None and not self._unscale():
            return  # non-finite gradients: skip this step, as GradScaler.step would
        if factor != 1.0:
            for m in self.masters:
                m.grad.mul_(factor)
        with host_memory():
            self.optimizer.step()
        for p, master in zip(self.params, self.masters):
            p.data.copy_(master, non_blocking=True)

    def _unscale(self) -> bool:
        """FP16 only: divide host gradients by the loss scale; False (and a smaller scale) on inf/NaN."""
        scale = float(self.scaler.get_scale())
        finite = all(math.isfinite(float(m.grad.abs().max())) for m in self.masters if m.grad.numel())
        if finite:
            for m in self.masters:
                m.grad.div_(scale)
            self.scaler.update(scale)
        else:
            self.scaler.update(scale * self.scaler.get_backoff_factor())
        return finite

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    @torch.no_grad()
    def restore(self) -> None:
        """Undo the offload: the weights back on the device in the dtype they came in, host copies released."""
        for p, master, dtype in zip(self.params, self.masters, self.dtypes):
            p.data = master.detach().to(p.device, dtype=dtype, copy=True)
            p.grad = None
        self.masters = []
        self.optimizer = None  # type: ignore[assignment]
