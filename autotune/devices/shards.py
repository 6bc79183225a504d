"""Whether a tensor is an FSDP2 shard (a `DTensor`) and which modules FSDP2 wraps, asked without importing
`torch.distributed.tensor` or `torch.distributed.fsdp`.

Those imports take more than a second of CPU (they bring in sympy), more than the rest of autotune together, and
`autotune run`, every trial process it starts and every plan-cache hit would pay it. A DTensor can only exist
once its module was imported, and a module is sharded only through `torch.distributed.fsdp` (its
`fully_shard`), so until then no tensor is a shard and no module a unit.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from typing import TypeGuard

    from torch import nn
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor


def is_shard(t: Any) -> TypeGuard[DTensor]:
    """True when `t` is a DTensor (an FSDP2 parameter, gradient or state shard)."""
    module = sys.modules.get("torch.distributed.tensor")
    kind = getattr(module, "DTensor", None)
    return kind is not None and isinstance(t, kind)


def is_fsdp_unit(module: nn.Module) -> bool:
    """Whether FSDP2 wraps `module` itself (its `__call__` runs FSDP's all-gather and reshard hooks)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    """The modules of `model` that FSDP2 wraps, in `model.modules()` order (the root first where it is one)."""
    if sys.modules.get("torch.distributed.fsdp") is None:
        return []
    return cast("list[FSDPModule]", [m for m in model.modules() if is_fsdp_unit(m)])
