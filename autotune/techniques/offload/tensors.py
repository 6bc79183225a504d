"""The offload rung's tensors: host copies, the dtypes a parameter keeps on the device and on the host, and
which parameters' masters go to the host.

Two strengths of the offload rung:
- `activations`: with every block checkpointed, the one tensor each block keeps (its input) goes to
  pinned host memory in forward and comes back for the recompute in backward (`to_host` / `to_device`).
  Pays at long sequences; at short ones the copies cost more than they save.
- `optimizer`: FP32 master weights and the optimizer state live on the host and are updated there
  (`host_engine.HostSteppedEngine`, or the host share streamed through the GPU where it can:
  `streamed_engine.StreamedEngine`); the GPU holds only 16-bit weights and gradients. For AdamW that takes
  the 16 bytes/parameter of FP32 weights + grads + two moments down to 4 (bf16 weights + grads).

On the simulated CPU device, host copies are made inside `host_memory()`, so the ceiling stops counting
them exactly as a GPU would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ... import settings
from ...devices.ceiling import host_memory
from .flat_layout import flat_views
from .local import local_part


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
    return settings.switch(settings.OFFLOAD_OVERLAP_ENV)


def leading(indices: Sequence[int], numels: Sequence[int], share: float) -> int:
    """How many of `indices`, from the first, hold `share` of their elements (fewest that reach it): the host
    share (`offload.host_share`) counts from the last parameter."""
    total = sum(numels[i] for i in indices)
    held = 0
    for k, i in enumerate(indices):
        if held >= share * total * (1 - 1e-9):
            return k
        held += numels[i]
    return len(indices)


def host_masters(params: Sequence[torch.Tensor], host_index: Sequence[int]) -> tuple[dict[int, torch.Tensor],
                                                                                  torch.Tensor | None]:
    """The host share's masters: where all have one dtype (FP32, or float64 for a float64 model), views of one
    pinned buffer in `host_index` order (the device stepper streams ranges of it; of an FSDP2 shard, this
    rank's part), with that buffer and no gradients yet (`give_gradients`); else one tensor each with its
    gradient, and None."""
    share = [params[i] for i in host_index]
    dtypes = {master_dtype(p) for p in share}
    if not share or len(dtypes) != 1 or not dtypes <= {torch.float32, torch.float64}:
        return {i: _host_master(params[i]) for i in host_index}, None
    local = [local_part(p.detach()) for p in share]
    flat, views = flat_views([t.shape for t in local], pin=share[0].device.type == "cuda", dtype=dtypes.pop())
    for t, master in zip(local, views):
        master.copy_(t)
    return dict(zip(host_index, views)), flat


def give_gradients(masters: dict[int, torch.Tensor]) -> None:
    """An FP32 gradient buffer for each host master that has none, pinned on CUDA (the CPU step reads them;
    the streamed step reads the device gradients, so its masters get none: 4 bytes a parameter saved)."""
    with host_memory():
        for master in masters.values():
            if master.grad is None:
                master.grad = torch.zeros_like(master, pin_memory=torch.cuda.is_available() and master.is_pinned())


def _host_master(p: torch.Tensor) -> torch.Tensor:
    fp = master_dtype(p)
    weight = local_part(p.detach())
    master = _pinned_copy(weight.to(fp)) if p.device.type != "cpu" else weight.to(fp, copy=True)
    master.grad = torch.zeros_like(master, pin_memory=p.device.type != "cpu")
    return master
