"""An OOM raised in `loss_fn` before the model runs, on one rank of an FSDP2-sharded model (two gloo ranks): the
other rank is already in FSDP's all-gather of the model's first block. In the loss check `fit` runs first on the
example batch, and in the trials, every rank leaves at the same collective: the check is skipped on both (its
note says why), the trials over the OOM rank's limit fail on both, and both get the same plan.
"""

from __future__ import annotations

import os

import pytest
import torch

TIMEOUT_S = 90  # the old hang held the ranks until the collective timeout (120 s, tests/ranks.py)
LIMIT = 2  # rank 1's loss_fn runs out of memory on more samples than this, before calling the model


def _fit(rank: int, world: int) -> dict:
    from test_step import Net, seq_batch

    import autotune
    from autotune.techniques.sharding import shard

    torch.manual_seed(0)
    model = shard(Net(width=32))

    def loss_fn(m, batch):
        x, y = batch
        if rank == 1 and len(x) > LIMIT:
            raise torch.OutOfMemoryError(f"CUDA out of memory (in loss_fn, on {len(x)} samples)")
        return m(x, y)

    plan = autotune.fit(model, seq_batch(8, 16, seed=rank, dtype=torch.float32), global_batch_size=8 * world,
                        loss_fn=loss_fn, memory_budget=2**30, device="cpu", cache=False, trial_steps=1,
                        techniques=("bf16",), progress=False)
    return {"micro": plan.micro_batch_size, "reason": plan.reason,
            "trials": [[t.rung.name, t.micro_batch_size, t.outcome] for t in plan.trials]}


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ranks import run_scenarios

    run_scenarios(rank, world, init_file, out_dir, ("fit",), lambda name, r, w: _fit(r, w))


@pytest.mark.slow  # two ranks under FSDP2
def test_an_oom_in_loss_fn_before_the_model_runs_fails_the_check_and_the_trials_on_every_rank() -> None:
    from ranks import spawn

    ranks = spawn(_rank_main, 2, TIMEOUT_S)
    for rank, r in enumerate(ranks):
        assert r["fit"]["ok"], f"rank {rank}:\n{r['fit']['error']}"
    results = [r["fit"] for r in ranks]
    assert results[0]["trials"] == results[1]["trials"]  # every trial agreed on
    assert results[0]["micro"] == results[1]["micro"] <= LIMIT
    assert any(outcome == "oom" and micro > LIMIT for _, micro, outcome in results[0]["trials"]), results[0]
    for r in results:  # the loss check's forwards failed on both ranks, at rank 1's OOM
        assert "the loss was not checked on the example batch (OutOfMemoryError: CUDA out of memory" in r["reason"], \
            r["reason"]
