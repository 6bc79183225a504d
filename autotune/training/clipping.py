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
  rounded to 16 bits twice.

The factor is torch's: `min(1, max_norm / (norm + 1e-6))`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from .. import parallel
from ..errors import InvalidSetting

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


def clip_model(model: nn.Module, max_norm: float, *, sharded: bool) -> float:
    """Clip the model's gradients in place to `max_norm`; the norm before clipping."""
    norm = global_norm(model, sharded=sharded)
    scale_gradients(_gradients(model), clip_factor(norm, max_norm))
    return norm
