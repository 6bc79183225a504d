"""Adam and AdamW over FSDP2 shards on a GPU step with torch's fused kernel where the user left the form unset:
torch's default there, foreach, holds the square root of every `exp_avg_sq` at once, one more state tensor at
the step. One rank under NCCL; the CPU tests cannot see it, since torch steps CPU tensors one by one.

    python -m pytest tests/test_fused_shards_gpu.py -m gpu -q
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import run_scenarios, spawn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TIMEOUT_S = 180


def _step_extra(model, optimizer, batch) -> int:
    """Bytes the optimizer step allocated above what was live when it began."""
    x, y = batch
    model(x, y).backward()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    optimizer.step()
    torch.cuda.synchronize()
    optimizer.zero_grad(set_to_none=False)
    return torch.cuda.max_memory_allocated() - before


def _scenario(name: str, rank: int, world: int) -> dict:
    from test_step import Net, seq_batch

    from autotune.search.floors import step_scratch
    from autotune.techniques.sharding import shard
    from autotune.workload.optimizers import OptimizerSpec, step_fused_on_shards

    torch.manual_seed(0)
    models = [shard(Net(width=1024, depth=4).cuda(), precision="fp32") for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    left = torch.optim.AdamW(models[0].parameters(), lr=1e-3)
    named = torch.optim.AdamW(models[1].parameters(), lr=1e-3, foreach=True)
    batch = tuple(t.cuda() for t in seq_batch(8, 64, seed=rank, dtype=torch.float32))
    for m, o in ((models[0], left), (models[1], named)):  # a first foreach step: `step` counters on the CPU
        _step_extra(m, o, batch)
    changed = step_fused_on_shards(left)
    assert changed and left.param_groups[0]["fused"] and not step_fused_on_shards(named)
    extras = [[_step_extra(m, o, batch) for _ in range(2)] for m, o in ((models[0], left), (models[1], named))]
    state = sum(p.to_local().numel() * 4 for p in models[0].parameters())
    # The foreach step holds one state tensor more; the fused one next to nothing.
    assert max(extras[1]) >= 0.9 * state, (extras, state)
    assert max(extras[0]) <= 0.1 * state, (extras, state)
    assert step_scratch(OptimizerSpec.from_user(left, models[0]), models[0], "cuda") == 0
    assert step_scratch(OptimizerSpec.from_user(named, models[1]), models[1], "cuda") == state
    # The same updates to within the forms' rounding: three steps of lr 1e-3 move a weight by up to 3e-3, and the
    # two forms order their arithmetic differently (torch makes no bitwise promise between them).
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=0, atol=3e-5)
    return {"extras": extras, "state": state}


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    run_scenarios(rank, world, init_file, out_dir, ["fused"], _scenario, backend="nccl")


def test_a_sharded_adamw_left_to_torch_steps_fused_without_the_foreach_temporary():
    (result,) = spawn(_rank_main, 1, TIMEOUT_S)
    assert result["fused"]["ok"], result["fused"].get("error")
