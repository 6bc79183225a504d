"""Whether a tensor is an FSDP2 shard (a `DTensor`), asked without importing `torch.distributed.tensor`.

That import takes about half a second (it brings in sympy), more than the rest of autotune together, and
`autotune run` and every trial process it starts would pay it. A DTensor can only exist once its module was
imported (FSDP2 imports it), so until then no tensor is one.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import TypeGuard

    from torch.distributed.tensor import DTensor


def is_shard(t: Any) -> TypeGuard[DTensor]:
    """True when `t` is a DTensor (an FSDP2 parameter, gradient or state shard)."""
    module = sys.modules.get("torch.distributed.tensor")
    kind = getattr(module, "DTensor", None)
    return kind is not None and isinstance(t, kind)
