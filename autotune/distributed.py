"""torch.distributed facts and the one collective autotune needs: agreeing on an OOM.

Under torchrun every rank runs the same trial; before anyone moves on, the ranks all-reduce the OOM
flag with MAX, so a rank that ran out of memory and ranks that did not take the same branch and no
rank is left waiting in a collective (PEERS.md lesson 10).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def is_writer() -> bool:
    """Only rank 0 writes shared state (the cache, result files)."""
    return rank() == 0


def agree_oom(oom: bool) -> bool:
    """True on every rank when any rank ran out of memory."""
    if not active():
        return oom
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if oom else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
