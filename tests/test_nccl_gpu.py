"""The grouped collectives under NCCL on two GPUs: what gloo (the CPU tests) never exercises.

`broadcast_together` and `all_reduce_together` send many tensors as one NCCL group; under gloo they fall back
to one collective per tensor, so only two real GPUs test the grouped path. Skipped with fewer than two.

    python -m pytest tests/test_nccl_gpu.py -m gpu -q
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import run_scenarios, spawn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs two CUDA GPUs")]

TIMEOUT_S = 120
SHAPES = [(3,), (1024, 7), (50_257, 64), (1,), (4096,)]  # odd sizes, one large, across both dtypes
SCENARIOS = ["broadcast", "all_reduce"]


def _tensors(rank: int) -> list[torch.Tensor]:
    """The same shapes on every rank, filled with values that name the rank and the position."""
    out = []
    for k, shape in enumerate(SHAPES * 2):
        dtype = torch.bfloat16 if k < len(SHAPES) else torch.float32
        t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) % 97
        out.append((t + 1000 * rank + k).to(dtype).cuda())
    return out


def _scenario(name: str, rank: int, world: int) -> dict:
    from autotune.parallel import all_reduce_together, broadcast_together

    if name == "broadcast":
        mine = _tensors(rank)
        sources = [k % world for k in range(len(mine))]  # alternate owners, as a partition's runs do
        broadcast_together(list(zip(mine, sources))).wait()
        expected = [_tensors(src)[k] for k, src in enumerate(sources)]
        return {"equal": all(torch.equal(a, b) for a, b in zip(mine, expected))}
    floats = [t for t in _tensors(rank) if t.dtype == torch.float32]
    all_reduce_together(floats).wait()
    summed = [sum(_tensors(r)[len(SHAPES) + k] for r in range(world)) for k in range(len(floats))]
    return {"equal": all(torch.equal(a, b) for a, b in zip(floats, summed))}


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    run_scenarios(rank, world, init_file, out_dir, SCENARIOS, _scenario, backend="nccl")


def test_grouped_broadcasts_and_all_reduces_reach_every_rank():
    results = spawn(_rank_main, 2, TIMEOUT_S)
    for rank, r in enumerate(results):
        for name in SCENARIOS:
            assert r[name]["ok"], f"rank {rank}, {name}: {r[name].get('error', '')[-2000:]}"
            assert r[name]["equal"], f"rank {rank}: a grouped {name} left a tensor unlike what it should hold"
