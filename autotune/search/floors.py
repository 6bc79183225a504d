"""Resident floors: the bytes a rung keeps on the device before any activation exists, and the rungs whose
floor alone is over the limit, left out before any trial."""

from __future__ import annotations

import torch
from torch import nn

from ..configuration import Rung
from ..devices.shards import is_fsdp_unit, is_shard
from ..sizes import format_bytes
from ..techniques import optimizer_8bit
from ..techniques.offload import device_dtype, local_part
from ..workload.optimizers import OptimizerSpec, foreach_stepped, fused_on_shards


def resident_floor(rung: Rung, model: nn.Module, state_tensors: int, *, scratch: int = 0) -> int:
    """Bytes the rung keeps on the device before any activation exists: weights, gradients and optimizer
    state on the lower rungs; 16-bit weights and gradients under optimizer offload. A lower bound. With
    `scratch` (`step_scratch`), the optimizer step's temporaries on the device count too: a bound for leaving
    rungs out, not a line's intercept, which the activations' peak sets while the step's comes later.

    An FSDP2 rank holds only its shard of each parameter (and of its gradient and state); under optimizer
    offload a shard keeps its FP32 weight and gradient (see offload's `Shares`); and a unit gathered whole for
    its forward and backward on top (`sharded_transients`).
    """
    on_device = rung.offload != "optimizer" and not rung.optimizer_8bit
    # The step's temporaries live after backward, when the gathered units are resharded: the larger of the two.
    return _state_floor(rung, model, state_tensors) + max(sharded_transients(model, rung.precision),
                                                          scratch if on_device else 0)


def step_scratch(spec: OptimizerSpec, model: nn.Module, device_type: str) -> int:
    """Bytes the device optimizer's step holds beyond its state: one state tensor of every group stepped with
    foreach (`foreach_stepped`), which on CUDA is torch's default and the form a sharded Adam is not left in.
    At the end of a step, not under the activations' peak; but on a rung whose state is most of the memory
    (an FSDP2 rank of GPT-2 XL: 3.1 GB beside 12.5 GB of shards and state) it is the peak."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return _held_bytes(trainable, foreach_stepped(spec, trainable, device_type))


def fused_note(spec: OptimizerSpec, model: nn.Module, device_type: str) -> list[str]:
    """The plan's word that a sharded Adam or AdamW steps fused (`step_fused_on_shards`), with what it saves."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = fused_on_shards(spec, trainable, device_type)
    if not fused:
        return []
    saved = _held_bytes(trainable, fused)
    return [f"{spec.cls_name} steps the shards with torch's fused kernel (its foreach form, torch's default here, "
            f"would hold {format_bytes(saved)} more per rank at the step)"]


def sharded_transients(model: nn.Module, precision: str) -> int:
    """What an FSDP2 rank holds for its units beyond its shards at the peak of a step, before activations:
    the largest unit's weights gathered whole in the compute dtype, twice (the unit running and the next one
    prefetched), with the shard copies that fed each gather, and in backward its gradient whole in the compute
    dtype beside the reduce-scatter's input in the reduce dtype (FP32 under BF16). 0 for a model not sharded.

    On the simulated CPU device (gloo) this accounts for what a sharded step's peak measures over the
    shards' weights, gradients and state (tests/test_sharding.py); the device's own allocator may add more.
    """
    units = [m for m in model.modules() if is_fsdp_unit(m)]
    if not units:
        return 0
    largest = max((_own_parameters(u) for u in units), key=lambda ps: sum(p.numel() for p in ps))
    numel = sum(p.numel() for p in largest)  # whole: a DTensor's numel is the unsharded one
    held = sum(_held(p) for p in largest)
    compute = 2 if precision in ("bf16", "fp16") else max((p.element_size() for p in largest), default=4)
    reduce = 4 if compute == 2 else compute  # FP32 reduction under 16-bit compute (`sharding.shard`)
    gathered = 2 * (numel + held) * compute
    gradients = numel * compute + (numel * reduce if reduce != compute else 0)
    return gathered + gradients


def _own_parameters(unit: nn.Module) -> list[nn.Parameter]:
    """The parameters `unit` gathers itself: not those of the units inside it."""
    inner = {id(p) for m in unit.modules() if m is not unit and is_fsdp_unit(m) for p in m.parameters()}
    return [p for p in unit.parameters() if id(p) not in inner]


def _state_floor(rung: Rung, model: nn.Module, state_tensors: int) -> int:
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    if rung.offload == "optimizer":  # each weight and gradient at its device dtype: 2 bytes from FP32
        def size(p: nn.Parameter) -> int:
            if is_shard(p):  # an FSDP2 shard keeps its dtype (see offload's Shares)
                return _held(p) * p.element_size()
            return _held(p) * torch.empty((), dtype=device_dtype(p, torch.bfloat16)).element_size()
        return sum(size(p) for p in params) + sum(size(p) for p in trainable)
    weights = sum(_held(p) * p.element_size() for p in params)
    grads = sum(_held(p) * p.element_size() for p in trainable)
    if rung.optimizer_8bit:
        return weights + grads + state_tensors * optimizer_8bit.STATE_BYTES * sum(_held(p) for p in trainable)
    return weights + (1 + state_tensors) * grads


def _held_bytes(params: list[nn.Parameter], indices: list[int]) -> int:
    """Bytes this rank holds of `params[i]` for each i in `indices`: one state tensor of those parameters."""
    return sum(_held(params[i]) * params[i].element_size() for i in indices)


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
