"""The rungs for several GPUs: the model replicated (data parallel) while it fits, FSDP2 sharding when it does not.

Replicated: every rank holds the whole model and `TrainingStep` sums the ranks' gradients in buckets while the
last micro-batch's backward runs, after the ranks agreed that none ran out of memory so far, and every rank
starts every bucket even when its backward ran out of memory (`distributed.OverlappedReduce`): no DDP
wrapper, whose hooks would leave the other ranks waiting in a collective that a failed rank never reaches.

Sharded: FSDP2 `fully_shard` on every repeated block and then on the root, so each rank holds 1/world of the
parameters, gradients and optimizer state and all-gathers one block at a time. `MixedPrecisionPolicy`
computes in BF16 and reduces gradients in FP32. Hybrid (`nodes` > 1): the same over a 2-D mesh, each parameter
sharded over the ranks of one node and replicated across nodes, so the all-gathers and reduce-scatters stay
inside a node and only an all-reduce of each shard's gradients crosses the link between nodes. Offload under
sharding is autotune's own (the optimizer state of the shards on the host, `offload/`), not FSDP2's
`CPUOffloadPolicy`.

`shard` works in place and cannot be undone (FSDP2 has no public "unshard for good"), and the optimizer
must be built after it over the sharded parameters. So it is not flipped on and off between trials: the
user shards before `fit`, or `fit` decides (`choose_sharding`) and tunes on a sharded copy, and
`plan.apply` shards the user's model and re-points the user's optimizer at the shards
(`shard_for_training`); see README "Several GPUs".
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import torch_private
from ..devices.shards import fsdp_units, is_fsdp_unit
from ..parallel.oom import param_groups  # the FSDP2 state's parameter groups, read the same way there
from ..parallel.ranks import collective_device
from ..parallel.topology import hybrid_mesh, slow_link, topology
from ..sizes import format_bytes
from .blocks import BlockGroup, find_blocks

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


def is_sharded(model: nn.Module) -> bool:
    """True when FSDP2 manages the model's parameters (they are DTensor shards, reduced by FSDP itself)."""
    return any(is_unit(m) for m in model.modules())


def is_unit(module: nn.Module) -> bool:
    """Whether FSDP2 wraps `module` itself (a unit): its `__call__` runs FSDP's all-gather and reshard hooks."""
    return is_fsdp_unit(module)


def shard(model: nn.Module, *, precision: str = "bf16", blocks: BlockGroup | None = None, nodes: int = 1) -> nn.Module:
    """Shard `model` in place with FSDP2: each repeated block is one unit, the root holds the rest.

    Args:
        model: the model, on this rank's device; torch.distributed must be initialised.
        precision: "bf16" computes with BF16 parameters and reduces gradients in FP32; "fp32" keeps FP32.
        blocks: the repeated blocks; default `find_blocks(model)`. Without any, the root is the only unit.
        nodes: 1 shards over every rank; more shards within each node and replicates across (hybrid sharding,
            on the job's own topology: `parallel.topology`).

    Returns:
        The same module object, now an FSDP module: build the optimizer after this call.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if precision == "bf16":
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mixed = MixedPrecisionPolicy()
    mesh = hybrid_mesh(nodes, collective_device().type) if nodes > 1 else None
    group = blocks if blocks is not None else find_blocks(model)
    for block in group.modules() if group is not None else []:
        fully_shard(block, mp_policy=mixed, mesh=mesh)
    fully_shard(model, mp_policy=mixed, mesh=mesh)
    slow_link(model, hybrid=nodes > 1, nodes=topology().nodes)
    return model


def reset_after_failure(model: nn.Module) -> None:
    """After a step that raised (an OOM mid-forward or mid-backward): put FSDP2 back in its idle state.

    A failed step leaves blocks unsharded (the module then holds plain tensors whose storage FSDP freed),
    all-gathers pending and per-iteration trackers set, and the next forward or optimizer would use them.
    First the device finishes every collective in flight (the ranks left the step at the same collective:
    `distributed.check_in`, so every collective issued was issued by all). Then `FSDPModule.reset_iter_state`
    (torch 2.13+) on the root reshards every group and drops the failed iteration's trackers and gradient
    reductions; on older torch `_reset_iter_state` does the same through FSDP's own fields (resharding
    alone after an OOM can be followed by an illegal memory access on every rank).
    A model that is not sharded is left alone.
    """
    units = fsdp_units(model)
    if not units:
        return
    device = next((p.device for p in model.parameters() if p.device.type == "cuda"), None)
    if device is not None:
        torch.cuda.synchronize(device)
    root = units[0]  # modules() starts at the model: the outermost FSDP module is the root
    if hasattr(root, "reset_iter_state"):
        root.reset_iter_state()
    else:
        _reset_iter_state(root)


def _reset_iter_state(root: FSDPModule) -> None:
    """`reset_iter_state` for torch before 2.13: the same fields, after the device has synchronized."""
    TrainingState = torch_private.fsdp_training_state()
    state = torch_private.fsdp_state(root)
    comm = state._comm_ctx
    comm.all_gather_state = None
    for name in ("reduce_scatter_states", "post_forward_order"):
        getattr(comm, name, []).clear()
    getattr(comm, "_last_post_reduce_events", {}).clear()
    for each in state._state_ctx.all_states:
        each._modules_to_run_forward.clear()
        each._training_state = TrainingState.IDLE
        for group in param_groups(each):
            result = group._all_gather_result
            if result is not None and isinstance(getattr(result, "all_gather_work", None), torch.distributed.Work):
                result.all_gather_work.wait()
            for name in ("_all_gather_result", "_post_reduce_event", "_all_reduce_state", "_partial_reduce_output",
                         "_reshard_after_forward_event"):
                if hasattr(group, name):
                    setattr(group, name, None)
            group._post_forward_indices.clear()
            group._training_state = TrainingState.IDLE
            group._to_sharded()
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False


def choose_sharding(model: nn.Module, replicated_floor: int, limit_bytes: int, world: int) -> tuple[str, str]:
    """("fsdp2" or "none", the reason): shard when the replicated model cannot hold its own state.

    `replicated_floor` is what every rank keeps with the model replicated and nothing offloaded (weights,
    gradients and optimizer state: `resident_floor` of the plain rung). Over the limit, no micro-batch fits
    replicated without optimizer offload, and sharding divides that floor by the world size while the
    GPU keeps the optimizer step (offload would move it to the host and copy every gradient over PCIe).
    One rank has nothing to shard over; a model the user sharded already stays as it is.
    """
    if is_sharded(model):
        return "fsdp2", "sharded with FSDP2 before fit"
    if world < 2 or replicated_floor <= limit_bytes:
        return "none", ""
    return "fsdp2", (f"sharded with FSDP2 over {world} ranks: replicated, weights, gradients and optimizer state "
                     f"need {format_bytes(replicated_floor)} per rank, over the {format_bytes(limit_bytes)} limit")


def sharded_copy(model: nn.Module, precision: str, nodes: int = 1) -> nn.Module:
    """A sharded deep copy of `model`, for the trials: `fit` must leave the user's model as it found it.

    Copy a model that is on the host (`fit` moves it there first): FSDP2 moves each shard to the mesh's
    device, so the device never holds a second whole model.
    """
    return shard(copy.deepcopy(model), precision=precision, nodes=nodes)


def shard_for_training(model: nn.Module, optimizer: object, *, precision: str, nodes: int = 1) -> None:
    """`plan.apply` under a sharded plan: shard `model` in place and re-point `optimizer` at the shards.

    The user's optimizer object is kept (an LR scheduler holds it, and so may a checkpointing callback):
    each group's parameters are swapped for their shards in place, hyperparameters and groups untouched,
    and any state it holds is cut to this rank's shard of each tensor.
    """
    old = {id(p): name for name, p in model.named_parameters()}
    shard(model, precision=precision, nodes=nodes)
    if isinstance(optimizer, torch.optim.Optimizer):
        _repoint(optimizer, old, dict(model.named_parameters()))


def _repoint(optimizer: torch.optim.Optimizer, names: dict[int, str], shards: dict[str, nn.Parameter]) -> None:
    from torch.distributed.tensor import distribute_tensor

    state = optimizer.state
    moved: dict[torch.Tensor, dict[str, object]] = {}
    for group in optimizer.param_groups:
        params: Sequence[nn.Parameter] = group["params"]
        new = [shards[names[id(p)]] if id(p) in names else p for p in params]
        for before, after in zip(params, new):
            if before in state:
                moved[after] = {k: _shard_like(v, after, distribute_tensor) for k, v in state[before].items()}
        group["params"] = new
    state.clear()
    state.update(moved)


def _shard_like(value: object, param: nn.Parameter, distribute) -> object:  # torch's function
    """A parameter-shaped state tensor cut to this rank's shard, laid out as the parameter; else as it is."""
    if (isinstance(value, torch.Tensor) and value.shape == param.shape and hasattr(param, "device_mesh")
            and hasattr(param, "placements")):  # a DTensor parameter has both
        local = value.detach().to(param.device)
        return distribute(local, param.device_mesh, param.placements, src_data_rank=None)
    return value
