"""Several ranks (gloo, CPU processes) tune together and end with one plan, whatever their ceilings."""

from __future__ import annotations

import json
import os
import tempfile
import traceback
from typing import Any

import pytest
import ranks  # tests/ranks.py: how a test starts its ranks
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow  # each test spawns ranks that run fit: about 30 s each on a 2-core machine

WORLD = 2


def _flat(plan: Any) -> dict:
    """The plan's fields in one flat dict, as the checks below read them; without the seconds each rank spent
    outside trials (its own loss check, snapshot, set-up), which the ranks do not agree on."""
    d = plan.to_dict()
    evidence = {k: v for k, v in d["evidence"].items() if k not in ("tune_seconds", "tune_phases")}
    return {**d["config"], **d["config"]["rung"], **evidence, **d["provenance"]}


def _rank_main(rank: int, init_file: str, out_dir: str, budgets: list[int]) -> None:
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpt import GPT, GPTConfig, random_batch
    from ranks import join, leave

    import autotune

    join(rank, WORLD, init_file)
    try:
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=64, n_layer=4, n_embd=32, n_head=4, seq_len=32)
        model = GPT(cfg)
        neighbour = 2**19 if rank == 1 else 0  # rank 1 shares its GPU: 0.5 MiB more in use, step after step
        crowd: list[torch.Tensor] = []

        def loss_fn(m, batch):
            crowd[:] = [torch.ones(neighbour // 4)]  # allocated under the trial's ceiling, held across the step
            return m(*batch)

        plan = autotune.fit(model, random_batch(cfg, 4), global_batch_size=16, memory_budget=budgets[rank],
                            device="cpu", cache=False, trial_steps=1, loss_fn=loss_fn)
        result = _flat(plan)
    except Exception:  # noqa: BLE001 - reported to the parent
        result = {"error": traceback.format_exc()}
    leave(rank, WORLD, out_dir, result)


def test_ranks_with_different_ceilings_agree_on_one_plan():
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        # different ceilings, and a neighbour on rank 1: the plan has to fit there, and rank 0 must follow it
        budgets = [3 * 2**20, int(2.5 * 2**20)]
        ctx = mp.start_processes(_rank_main, args=(init_file, tmp, budgets), nprocs=WORLD, join=False,
                                 start_method=ranks.START_METHOD)
        for _ in range(300):
            if ctx.join(timeout=1):
                break
        else:
            for p in ctx.processes:
                p.kill()
            pytest.fail("ranks did not finish within 300 s (a collective left waiting?)")
        plans = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(WORLD)]
    for rank, p in enumerate(plans):
        assert "error" not in p, f"rank {rank}:\n{p['error']}"
    notes = [[t.pop("note") for t in p["trials"]] for p in plans]
    assert plans[0] == plans[1]  # same plan, same trials, same figures on both ranks
    plan = plans[0]
    assert plan["world_size"] == WORLD
    assert plan["micro_batch_size"] * (plan["accumulation_steps"] - 1) + plan["last_micro_batch_size"] == 16 // WORLD
    assert plan["peak_memory_bytes"] <= 0.9 * budgets[1]
    # Where rank 1 failed and rank 0 did not, rank 0 followed it ("another rank ..."). Which micro-batches are
    # tried depends on measured times (a loaded machine re-measures noisy trials), so a run may try none in
    # the 0.5 MiB gap between the ranks; every failed trial is then rank 0's own as well.
    failed = [(t["outcome"], n) for t, n in zip(plans[0]["trials"], notes[0]) if t["outcome"] != "ok"]
    assert failed, "the 2.5 MiB ceiling should have stopped some trial"
    assert all(n.startswith("another rank") or "simulated ceiling" in n or "over the" in n for _, n in failed), notes
    assert plan["memory_budget_bytes"] == min(budgets)
    # Last, the pick's all-reduced step timed both ways (search/reduce_timing.py), one decision on both ranks
    timed = plan["trials"][-1]
    knobs = ("precision", "checkpointing", "offload", "checkpointed_blocks", "compile")
    assert {k: timed["rung"][k] for k in knobs} == {k: plan[k] for k in knobs}, plan["reason"]
    assert timed["sharding"] == ("optimizer_state" if plan["sharding"] == "optimizer_state" else "none")
    assert timed["micro_batch_size"] >= plan["micro_batch_size"]  # the split may balance a last 1 away
    assert "in one after it" in notes[0][-1] or timed["outcome"] != "ok", notes[0][-1]
    assert plan["reduce_overlap"] in (True, False)
    assert ("in one bucket after backward" in plan["reason"]) == (plan["reduce_overlap"] is False), plan["reason"]


def _share_main(rank: int, world: int, init_file: str, out_dir: str, budget: int) -> None:
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ranks import join, leave
    from test_offload import Wide

    import autotune

    join(rank, world, init_file)
    try:
        torch.manual_seed(0)
        plan = autotune.fit(Wide(), torch.randn(4, 96), global_batch_size=8, memory_budget=budget, device="cpu",
                            cache=False, techniques=("bf16", "offload"), max_trials=8)
        result = _flat(plan)
    except Exception:  # noqa: BLE001 - reported to the parent
        result = {"error": traceback.format_exc()}
    leave(rank, world, out_dir, result)


def test_replicated_ranks_choose_one_partial_offload_share():
    # Two H100s streamed all of GPT-2 medium's optimizer state each step where a share would have fitted:
    # replicated ranks now choose the share as one process does, together.
    from ranks import spawn
    from test_offload import Wide

    numel = sum(p.numel() for p in Wide().parameters())
    # The limit just over the replicated floor (FP32 weights, gradients, AdamW moments: 16 bytes a parameter),
    # so the model stays replicated (not sharded), plain BF16 runs out at micro-batch 1 and full optimizer
    # offload leaves room for a share of the state on the device.
    budget = int(16 * numel * 1.03 / 0.9)
    plans = spawn(_share_main, WORLD, 300, budget)
    for rank, p in enumerate(plans):
        assert "error" not in p, f"rank {rank}:\n{p['error']}"
    for p in plans:
        for t in p["trials"]:
            t.pop("note")
    assert plans[0] == plans[1]  # one share, from the same trials, on both ranks
    plan = plans[0]
    assert plan["world_size"] == WORLD and plan["offload"] == "optimizer"
    assert 0 < plan["offload_fraction"] < 1, plan["reason"]
    assert plan["peak_memory_bytes"] <= 0.9 * budget
