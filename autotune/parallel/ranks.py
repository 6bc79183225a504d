"""Which rank this process is, and the small collectives over a figure or two: budgets, counts, sums."""

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


def collective_device() -> torch.device:
    """Where a tensor must be for a collective of the current backend (CUDA for NCCL, else the CPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def smallest(value: int) -> int:
    """The smallest `value` over all ranks (a memory budget: the plan must fit on the tightest GPU)."""
    if not active():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def sum_over_ranks(values: list[float]) -> list[float]:
    """Each figure summed over all ranks (float64: sample and token counts add exactly)."""
    if not active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(t)
    return t.tolist()


def total_and_range(samples: int, steps: int) -> tuple[float, int, int]:
    """(samples summed over ranks, fewest micro-steps of any rank, most micro-steps of any rank)."""
    if not active():
        return float(samples), steps, steps
    t = torch.tensor([float(samples), -float(steps), float(steps)], dtype=torch.float64, device=collective_device())
    total = t[:1].clone()
    dist.all_reduce(total)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(total.item()), int(-t[1].item()), int(t[2].item())
