"""The rungs for several GPUs: the model replicated (data parallel) while it fits, FSDP2 sharding when it does not.

Replicated: every rank holds the whole model and `TrainingStep` sums the ranks' gradients once per optimizer
step, after the ranks agreed that none ran out of memory (`distributed.reduce_gradients`): no DDP wrapper,
so no collective starts inside a backward that another rank may never reach.

Sharded: FSDP2 `fully_shard` on every repeated block and then on the root, so each rank holds 1/world of the
parameters, gradients and optimizer state and all-gathers one block at a time. `MixedPrecisionPolicy`
computes in BF16 and reduces gradients in FP32; `CPUOffloadPolicy` is the offload rung there (the sharded
parameters, gradients and optimizer state on the host, the optimizer stepping on the CPU).

`shard` works in place and cannot be undone (FSDP2 has no public "unshard for good"), and the optimizer
must be built after it over the sharded parameters. So it is applied by the user (or `plan.apply`) before
`fit`, not flipped on and off between trials; see README "Several GPUs".
"""

from __future__ import annotations

import torch
from torch import nn

from .checkpointing import BlockGroup, find_blocks


def is_sharded(model: nn.Module) -> bool:
    """True when FSDP2 manages the model's parameters (they are DTensor shards, reduced by FSDP itself)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def shard(model: nn.Module, *, precision: str = "bf16", offload: bool = False,
          blocks: BlockGroup | None = None) -> nn.Module:
    """Shard `model` in place with FSDP2: each repeated block is one unit, the root holds the rest.

    Args:
        model: the model, on this rank's device; torch.distributed must be initialised.
        precision: "bf16" computes with BF16 parameters and reduces gradients in FP32; "fp32" keeps FP32.
        offload: keep the sharded parameters, gradients and optimizer state on the host (`CPUOffloadPolicy`).
        blocks: the repeated blocks; default `find_blocks(model)`. Without any, the root is the only unit.

    Returns:
        The same module object, now an FSDP module: build the optimizer after this call.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if precision == "bf16":
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mixed = MixedPrecisionPolicy()
    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    group = blocks if blocks is not None else find_blocks(model)
    for block in group.blocks if group is not None else []:
        fully_shard(block, mp_policy=mixed, offload_policy=policy)
    fully_shard(model, mp_policy=mixed, offload_policy=policy)
    return model
