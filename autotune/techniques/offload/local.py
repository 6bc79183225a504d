"""This rank's part of a tensor that FSDP2 shards."""

from __future__ import annotations

import torch

from ...devices.shards import is_shard


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter or gradient (a DTensor), viewing its storage; else `t`.

    Host copies are plain tensors: copying a DTensor into one raises "mixed torch.Tensor and DTensor",
    and each rank only ever updates its own shard.
    """
    return t.to_local() if is_shard(t) else t
