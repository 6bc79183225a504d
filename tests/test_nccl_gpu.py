"""The grouped collectives under NCCL on two GPUs: what gloo (the CPU tests) never exercises.

`broadcast_together` and `all_reduce_together` send many tensors as one NCCL group; under gloo they fall back
to one collective per tensor, so only two real GPUs test the grouped path. Skipped with fewer than two.

    python -m pytest tests/test_nccl_gpu.py -m gpu -q
"""

from __future__ import annotations

import datetime
import json
import os

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs two CUDA GPUs")]

TIMEOUT_S = 120
SHAPES = [(3,), (1024, 7), (50_257, 64), (1,), (4096,)]  # odd sizes, one large, across both dtypes


def _tensors(rank: int) -> list[torch.Tensor]:
    """The same shapes on every rank, filled with values that name the rank and the position."""
    out = []
    for k, shape in enumerate(SHAPES * 2):
        dtype = torch.bfloat16 if k < len(SHAPES) else torch.float32
        t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) % 97
        out.append((t + 1000 * rank + k).to(dtype).cuda())
    return out


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from autotune.training.distributed import all_reduce_together, broadcast_together

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    result: dict = {}
    try:
        mine = _tensors(rank)
        sources = [k % world for k in range(len(mine))]  # alternate owners, as a partition's runs do
        broadcast_together(list(zip(mine, sources))).wait()
        expected = [_tensors(src)[k] for k, src in enumerate(sources)]
        result["broadcast"] = all(torch.equal(a, b) for a, b in zip(mine, expected))
        floats = [t for t in _tensors(rank) if t.dtype == torch.float32]
        all_reduce_together(floats).wait()
        summed = [sum(_tensors(r)[len(SHAPES) + k] for r in range(world)) for k in range(len(floats))]
        result["all_reduce"] = all(torch.equal(a, b) for a, b in zip(floats, summed))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        result["error"] = repr(exc)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


def test_grouped_broadcasts_and_all_reduces_reach_every_rank():
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_main, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True,
                           start_method="spawn")
        results = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(2)]
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: {r['error']}"
        assert r["broadcast"], f"rank {rank}: a grouped broadcast left a tensor unlike its source's"
        assert r["all_reduce"], f"rank {rank}: a grouped all-reduce left a tensor unlike the sum"
