"""Model FLOPs per sample, counted once per tune, and the MFU they give a plan.

The count is one forward+backward of the plain model (no rung applied) on a small micro-batch under
`torch.utils.flop_counter.FlopCounterMode`, which adds up the matmuls, convolutions and attention kernels
torch actually dispatches: no formula to get wrong for an unusual model. Fused attention is counted by
`attention_flops.py`, which knows grouped-query attention (fewer key/value heads than query heads). It is the
"model FLOPs" of MFU (PaLM, appendix B): recomputation under checkpointing is left out on purpose, so a plan
that recomputes shows the utilization a user gets out of the GPU, not the work it did.

Where the full count does not fit (a model whose FP32 weights and gradients together exceed the budget, the
very models optimizer offload is for), the forward alone is counted without gradients and tripled: the
backward of a matmul or an attention kernel costs twice its forward (gradients for the inputs and for the
weights), the convention of MFU's 6N per token.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..devices.peaks import DevicePeak
from ..devices.placement import Placement
from ..errors import DeviceError, is_device_poisoned, is_oom
from ..workload import batch as batches
from ..workload.losses import LossFn, full_batch_loss
from .attention_flops import ATTENTION_FORMULAS

COUNT_SAMPLES = 2  # two, not one: batch norm in training mode refuses a batch of one


@dataclass(frozen=True, slots=True)
class FlopCount:
    """Forward+backward FLOPs of one sample, or None with the reason they could not be counted."""

    per_sample: float | None
    why_not: str = ""


def count_flops(model: nn.Module, batch: Any, loss_fn: LossFn, placement: Placement) -> FlopCount:
    """Forward+backward FLOPs of one sample of `batch` (already on the device); None, with the reason for the
    plan's, if counting ran out of memory.

    The model's gradients are left as None; the caller restores weights, buffers and RNG (a snapshot),
    since the count runs the model's own forward (dropout draws, batch norm statistics).
    """
    n = min(COUNT_SAMPLES, batches.batch_size(batch))
    part = batches.unwrap(batches.resize(batch, n))  # as the model gets it: `Shared` tensors plain
    total: float | None = None
    try:
        total = _count(model, part, loss_fn)
    except Exception as exc:  # an OOM only leaves MFU unknown; anything else is the model's own
        if is_device_poisoned(exc):  # no clean-up: every CUDA call would fail again and hide this error
            raise DeviceError(f"CUDA error while counting the model's FLOPs: {exc}. The CUDA context is unusable; "
                              "restart the process.") from exc
        if not is_oom(exc):
            raise
    # Out of the except block, so a failed step's tensors are free to go (trial.py does the same).
    _clean_up(model, placement)
    if total is None:
        total = _forward_only(model, part, loss_fn, placement, n)
    if total is None:
        return FlopCount(None, f"counting FLOPs at micro-batch {n} ran out of memory, even without gradients")
    return FlopCount(total / n)


def _forward_only(model: nn.Module, batch: Any, loss_fn: LossFn, placement: Placement, n: int) -> float | None:
    """Three times the forward's FLOPs, counted without gradients; None if even that runs out of memory."""
    total: float | None = None
    try:
        model.train()
        counter = FlopCounterMode(display=False, custom_mapping=ATTENTION_FORMULAS)
        with torch.no_grad(), counter:
            loss_fn(model, batch)
        total = 3.0 * counter.get_total_flops()
    except Exception as exc:  # as in the full count: an OOM only leaves MFU unknown
        if not is_oom(exc):
            raise
    _clean_up(model, placement)
    return total


def utilization(flops: float | None, samples_per_second: float, world_size: int, peak: DevicePeak,
                precision: str) -> float | None:
    """Achieved model FLOP/s per GPU over the GPU's peak for `precision`; None where either is unknown.

    `samples_per_second` is over all ranks, as plans and trials report it.
    """
    ceiling = peak.flops(precision)
    if flops is None or not ceiling or samples_per_second <= 0:
        return None
    return flops * samples_per_second / world_size / ceiling


def _count(model: nn.Module, batch: Any, loss_fn: LossFn) -> float:
    model.train()
    counter = FlopCounterMode(display=False, custom_mapping=ATTENTION_FORMULAS)
    with counter:
        full_batch_loss(loss_fn(model, batch)).backward()
    return float(counter.get_total_flops())


def _clean_up(model: nn.Module, placement: Placement) -> None:
    for p in model.parameters():
        p.grad = None
    gc.collect()
    if not placement.simulated:
        # The count's blocks must not stay reserved: the first trial's peak reads reserved memory.
        torch.cuda.synchronize(placement.index)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(placement.index)
