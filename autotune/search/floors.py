"""Resident floors: the bytes a rung keeps on the device before any activation exists, and the rungs whose
floor alone is over the limit, left out before any trial."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..configuration import Rung
from ..sizes import format_bytes
from ..techniques import optimizer_8bit
from ..techniques.offload import device_dtype, local_part


def resident_floor(rung: Rung, model: nn.Module, state_tensors: int) -> int:
    """Bytes the rung keeps on the device before any activation exists: weights, gradients and optimizer
    state on the lower rungs; 16-bit weights and gradients under optimizer offload. A lower bound.

    An FSDP2 rank holds only its shard of each parameter (and of its gradient and state); under optimizer
    offload a shard keeps its FP32 weight and gradient (see `HostOptimizer`).
    """
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    if rung.offload == "optimizer":  # each weight and gradient at its device dtype: 2 bytes from FP32
        def size(p: nn.Parameter) -> int:
            if isinstance(p, DTensor):  # an FSDP2 shard keeps its dtype (see HostOptimizer)
                return _held(p) * p.element_size()
            return _held(p) * torch.empty((), dtype=device_dtype(p, torch.bfloat16)).element_size()
        return sum(size(p) for p in params) + sum(size(p) for p in trainable)
    weights = sum(_held(p) * p.element_size() for p in params)
    grads = sum(_held(p) * p.element_size() for p in trainable)
    if rung.optimizer_8bit:
        return weights + grads + state_tensors * optimizer_8bit.STATE_BYTES * sum(_held(p) for p in trainable)
    return weights + (1 + state_tensors) * grads


def _held(p: torch.Tensor) -> int:
    """Elements of `p` this rank holds: its local shard under FSDP2, else all of them."""
    return local_part(p.detach()).numel()


def drop_rungs_over(rungs: list[Rung], floors: list[int], limit_bytes: int) -> tuple[list[Rung], list[str]]:
    """Leave out the rungs whose resident floor alone is over the limit: no micro-batch can fit there, and
    a trial would only run out of memory (GPT-2 XL's FP32 weights, gradients and AdamW state are 24 GB,
    over a 16 GiB card). The top rung always stays, so a plan that cannot exist fails with its trial."""
    over = [i for i, floor in enumerate(floors) if floor > limit_bytes and i < len(rungs) - 1]
    if not over:
        return list(rungs), []
    note = (f"{', '.join(rungs[i].name for i in over)} skipped: weights, gradients and optimizer state alone "
            f"need {format_bytes(min(floors[i] for i in over))} or more, over the {format_bytes(limit_bytes)} limit")
    return [r for i, r in enumerate(rungs) if i not in over], [note]
