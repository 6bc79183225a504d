"""Gradient clipping over the whole global batch: `plan.apply(model, optimizer, max_grad_norm=1.0)`.

Training loops clip the global L2 norm of the gradient before the optimizer step (HF Trainer's
`max_grad_norm=1.0` by default, Lightning's `gradient_clip_val`, Accelerate's `clip_grad_norm_`). Under
accumulation the norm must be the full batch's, so `TrainingStep` clips once, after the last micro-batch,
after the gradients were reduced over ranks, and (FP16) after unscaling: the update then equals
`clip_grad_norm_` on one full-batch step followed by the optimizer step.

Where the gradient lives differs by path, the arithmetic does not:
- replicated (one process, or data parallel after `OverlappedReduce`): every rank holds the whole
  gradient, so the local norm is the global one and no collective runs;
- sharded (FSDP2): each rank holds a shard (`DTensor.to_local()`); the squares are summed over ranks;
- optimizer offload: the device gradients (16-bit, loss-scaled under FP16) give the norm; the factor is
  applied to the FP32 host gradients after they are unscaled (`HostOptimizer.grad_factor`), so nothing is
  rounded to 16 bits twice. Except where a `before_optimizer_step` callback runs: it is documented to see
  the gradients after clipping, as on every other plan (and as a plain loop's code between
  `clip_grad_norm_` and `optimizer.step()` does), and what it leaves in them is what the optimizer steps
  with. There the device gradients are clipped in place, as on a plain plan, and the engine, which reads
  them after the callback (a callback turns the overlap with backward off), steps with them as they are.

The factor is torch's: `min(1, max_norm / (norm + 1e-6))`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from .. import parallel
from ..errors import InvalidSetting
from ..techniques.offload import OptimizerOffload

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: keeps the factor finite at a zero norm


def check_max_norm(max_grad_norm: float | None) -> float | None:
    """The setting, validated: None (no clipping) or a positive number (inf measures without clipping)."""
    if max_grad_norm is None:
        return None
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0:
        raise InvalidSetting(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r} "
                             "(e.g. max_grad_norm=1.0, as HF Trainer's default)")
    return float(max_grad_norm)


def _local(grad: torch.Tensor) -> torch.Tensor:
    # FSDP2 gradients are DTensors: this rank's shard is the part it owns; padding is not in it.
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


def _gradients(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def global_norm(model: nn.Module, *, sharded: bool, scale: float = 1.0) -> float:
    """The L2 norm of the whole gradient, divided by `scale` (the FP16 loss scale still in the gradients).

    Each gradient's norm is taken in its own dtype, or FP32 for 16-bit ones (the squares of a BF16
    gradient overflow nothing in FP32 and keep its precision); the sum of squares is float64.
    """
    squares = torch.zeros((), dtype=torch.float64)
    for g in _gradients(model):
        local = _local(g)
        if local.numel() == 0:
            continue
        dtype = torch.float32 if local.dtype in (torch.float16, torch.bfloat16) else local.dtype
        norm = torch.linalg.vector_norm(local, 2, dtype=dtype)
        squares += norm.double().cpu() ** 2
    if sharded and parallel.active():  # each rank holds a shard: the squares add up over ranks
        total = squares.to(parallel.collective_device())
        torch.distributed.all_reduce(total)
        squares = total.cpu()
    return math.sqrt(float(squares)) / scale


def clip_factor(norm: float, max_norm: float) -> float:
    """What the gradients are multiplied by: 1 when the norm is within `max_norm` (or not finite)."""
    if not math.isfinite(norm):
        return 1.0  # inf/NaN gradients: FP16 skips the step anyway; scaling them would not make them finite
    return min(1.0, max_norm / (norm + EPS))


@torch.no_grad()
def scale_gradients(grads: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every gradient by `factor` in place (on a DTensor, its local shard)."""
    if factor == 1.0:
        return
    for g in grads:
        _local(g).mul_(factor)


def clip(model: nn.Module, max_norm: float, offload: OptimizerOffload, *, sharded: bool,
         scaler: torch.amp.GradScaler | None = None, seen: bool = False) -> float:
    """Clip the whole batch's gradient before the optimizer step; the norm before clipping.

    Args:
        offload: the plan's optimizer offload (`offload_of`): when engaged the engine applies the factor to
            its FP32 copies, unless `seen`.
        scaler: FP16's loss scaler: under optimizer offload the device gradients still carry its scale (the
            engine unscales its own copies), which the norm is divided by; elsewhere they were unscaled.
        seen: a `before_optimizer_step` callback looks at the gradients before the step: they are clipped in
            place on every plan, so it sees the clipped gradients whatever the plan.
    """
    scale = float(scaler.get_scale()) if offload.engaged and scaler is not None else 1.0
    norm = global_norm(model, sharded=sharded, scale=scale)
    factor = clip_factor(norm, max_norm)
    if offload.engaged and not seen:
        offload.scale_gradients(factor)
    else:
        scale_gradients(_gradients(model), factor)
    return norm
