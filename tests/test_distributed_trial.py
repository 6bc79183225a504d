"""A trial on replicated ranks prices the gradient all-reduce (gloo, CPU processes): the all-reduced step runs on
every rank or on none, so a rank whose trial ran out of memory leaves nobody waiting in it."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ranks import run_scenarios, spawn  # noqa: E402

WORLD = 2
MiB = 2**20


def _trial(rank: int, budget: int) -> dict:
    """One trial of an embedding-heavy model (6.4 MB of gradients, little compute), on this rank's ceiling."""
    import torch
    from torch import nn

    from autotune.devices.placement import resolve_device
    from autotune.plan import Rung
    from autotune.search.trial import TrialRunner, Workload
    from autotune.training import distributed
    from autotune.workload.optimizers import OptimizerSpec

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50_000, 32), nn.Linear(32, 1))
    batch = torch.randint(0, 50_000, (8, 16))
    work = Workload(model=model, batch=batch, loss_fn=lambda m, b: m(b).square().mean(),
                    spec=OptimizerSpec.from_user(None, model), placement=resolve_device("cpu"),
                    budget_bytes=budget, limit_bytes=int(0.9 * budget), per_rank=8, world_size=WORLD)
    trial = TrialRunner(work, agree=distributed.agree_trial)(Rung(precision="fp32"), 4)
    return {"trial": {**trial.to_dict(), "note": ""}}


def _scenario(name: str, rank: int, world: int) -> dict:
    if name == "roomy":
        return _trial(rank, 512 * MiB)
    if name == "one_rank_short":  # rank 1 cannot hold the AdamW state: it runs out of memory in its warm-up step
        return _trial(rank, 512 * MiB if rank == 0 else 12 * MiB)
    raise ValueError(name)


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    run_scenarios(rank, world, init_file, out_dir, ["roomy", "one_rank_short"], _scenario)


@pytest.mark.slow  # two spawned ranks: about 20 s on a 2-core machine
def test_a_replicated_trial_prices_the_all_reduce_and_no_rank_waits_for_a_failed_one():
    results = spawn(_rank_main, WORLD, 240)
    for name in ("roomy", "one_rank_short"):
        assert all(r[name]["ok"] for r in results), [r[name].get("error", "")[-2000:] for r in results]
    roomy = [r["roomy"]["trial"] for r in results]
    assert roomy[0] == roomy[1]  # one agreed trial on every rank
    assert roomy[0]["outcome"] == "ok" and roomy[0]["reduce_seconds"] > 0
    # A cost once per global step, charged with the optimizer's
    assert roomy[0]["optimizer_seconds"] >= roomy[0]["reduce_seconds"]
    short = [r["one_rank_short"]["trial"] for r in results]
    assert [t["outcome"] for t in short] == ["oom", "oom"] and all(t["reduce_seconds"] == 0 for t in short)
