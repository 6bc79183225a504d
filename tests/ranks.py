"""Joining a spawned test rank to its gloo group: the one place the rank processes' setup lives.

Every multi-rank test spawns its ranks on a 2-core CI machine. Two settings keep them honest there:
- one intra-op thread per rank: 4 ranks at torch's default (one thread per core) oversubscribe the cores
  several times over, and under FSDP the simulated ceiling then saw the ranks reach different counts (a
  gloo thread releasing a buffer earlier on one rank), so one rank ran out of memory inside a forward while
  the others waited in FSDP's all-gather: a hang that held CI past its limit;
- a collective timeout well under the parent's join deadline, so a collective left waiting fails on the ranks
  with gloo's own error (reported to the parent) instead of hanging until the parent kills them.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 120  # under test_distributed_step's 180 s join deadline


def join(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
