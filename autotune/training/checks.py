"""What a training step checks before it trains: the plan, the model's device, the host's memory, one open
step per model, and (warned once) batches other than the plan was made for."""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import parallel
from ..configuration import FSDP
from ..devices import host as host_memory
from ..devices.headroom import shortfall
from ..devices.placement import Placement, refuse_meta, resolve_device
from ..errors import InvalidSetting
from ..sizes import format_bytes
from ..techniques.sharding import is_sharded, shard_for_training
from ..workload import batch as batches
from . import recovery

if TYPE_CHECKING:  # plan.py sits above training/ and imports it
    from ..plan import Plan

log = logging.getLogger(__name__)

_PLAN_FIELDS = ("rung", "micro_batch_size", "per_rank_batch_size", "memory_budget_bytes")

# The open step of each model: a second `apply` on top of the first would build its offload over the first's
# 16-bit working copies, and the two would each step the model, one update lost.
_OPEN: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def prepare(plan: Plan, model: nn.Module, optimizer: Any) -> Placement:
    """Check `plan` against `model` and this machine (sharding the model where the plan says so); its placement."""
    if not all(hasattr(plan, name) for name in _PLAN_FIELDS):
        raise InvalidSetting(f"plan must be an autotune.Plan, got {type(plan).__name__}")
    if not isinstance(model, nn.Module):
        raise InvalidSetting(f"model must be a torch.nn.Module, got {type(model).__name__}")
    refuse_meta(model)
    _refuse_second_step(model)
    placement = _placement(plan, model)
    short = shortfall(plan.peak_memory_bytes, placement, "the plan")  # memory taken since tuning?
    if short is not None:
        log.warning("autotune: %s", short)
    _check_host(plan)
    if plan.sharding in FSDP and not is_sharded(model):  # fit chose FSDP2: shard here, for good
        _shard(plan, model, optimizer)
    return placement


def opened(model: nn.Module, step: Any) -> None:
    _OPEN[model] = weakref.ref(step)


def closed(model: nn.Module, step: Any) -> None:
    if _OPEN.get(model, lambda: None)() is step:
        del _OPEN[model]


class BatchWarnings:
    """Warn once when a batch has another size than the plan's per-rank batch, or is longer than `max_length`."""

    def __init__(self) -> None:
        self._warned_size = False
        self._warned_length = False

    def check(self, plan: Plan, batch: Any, n: int) -> None:
        self._check_size(plan, n)
        self._check_length(plan, batch)

    def _check_size(self, plan: Plan, n: int) -> None:
        if n != plan.per_rank_batch_size and not self._warned_size:
            self._warned_size = True
            log.warning("autotune: step(batch) got %d samples but the plan was made for %d per rank; the step is "
                        "still exact for the batch it gets (global batch = what you pass)",
                        n, plan.per_rank_batch_size)

    def _check_length(self, plan: Plan, batch: Any) -> None:
        """Warn once when a batch is longer than the longest sequence the plan was tuned for (`max_length`)."""
        length = batches.tokens_per_sample(batch)
        if self._warned_length or plan.max_length is None or length is None or length <= plan.max_length:
            return
        self._warned_length = True
        log.warning("autotune: a batch of %d tokens per sample is longer than the %d the plan was tuned for "
                    "(max_length): its peak may pass the plan's; tune with fit(..., max_length=%d) (autotune run "
                    "--max-length), or cut the batches", length, plan.max_length, length)


def _refuse_second_step(model: nn.Module) -> None:
    ref = _OPEN.get(model)
    step = ref() if ref is not None else None
    if step is not None and step._applied is not None:
        raise InvalidSetting(f"this model already has an open training step (plan.apply was called on it before, "
                             f"{recovery.describe(step.plan)}); call step.close() on that one first, or keep using it")


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
        raise InvalidSetting(f"the plan shards the model with FSDP2 (plan.sharding={plan.sharding!r}) but "
                             "torch.distributed is not initialised: launch with torchrun as when tuning, or tune again "
                             "on one process")
    shard_for_training(model, optimizer, precision=plan.precision,
                       nodes=plan.config.nodes if plan.sharding == "hsdp" else 1)
