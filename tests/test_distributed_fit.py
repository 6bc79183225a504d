"""Several ranks (gloo, CPU processes) tune together and end with one plan, whatever their ceilings."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow  # spawned ranks that run two fits: about 30 s on a 2-core machine

WORLD = 2
TIMEOUT_S = 300
# different ceilings, and a neighbour on rank 1: the plan has to fit there, and rank 0 must follow it
BUDGETS = [3 * 2**20, int(2.5 * 2**20)]


def _flat(plan: Any) -> dict:
    """The plan's fields in one flat dict, as the checks below read them; without the seconds each rank spent
    outside trials (its own loss check, snapshot, set-up), which the ranks do not agree on."""
    d = plan.to_dict()
    evidence = {k: v for k, v in d["evidence"].items() if k not in ("tune_seconds", "tune_phases")}
    return {**d["config"], **d["config"]["rung"], **evidence, **d["provenance"]}


def _different_ceilings(rank: int) -> dict:
    """fit of a small GPT under this rank's budget, rank 1 with a neighbour's 0.5 MiB held through each step."""
    from gpt import GPT, GPTConfig, random_batch

    import autotune

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, n_layer=4, n_embd=32, n_head=4, seq_len=32)
    model = GPT(cfg)
    neighbour = 2**19 if rank == 1 else 0  # rank 1 shares its GPU: 0.5 MiB more in use, step after step
    crowd: list[torch.Tensor] = []

    def loss_fn(m, batch):
        crowd[:] = [torch.ones(neighbour // 4)]  # allocated under the trial's ceiling, held across the step
        return m(*batch)

    plan = autotune.fit(model, random_batch(cfg, 4), global_batch_size=16, memory_budget=BUDGETS[rank],
                        device="cpu", cache=False, trial_steps=1, loss_fn=loss_fn)
    return _flat(plan)


def _share_budget() -> int:
    """The limit just over the replicated floor of test_offload.Wide (FP32 weights, gradients, AdamW moments: 16
    bytes a parameter), so the model stays replicated (not sharded), plain BF16 runs out at micro-batch 1 and
    full optimizer offload leaves room for a share of the state on the device."""
    from test_offload import Wide

    numel = sum(p.numel() for p in Wide().parameters())
    return int(16 * numel * 1.03 / 0.9)


def _partial_offload_share(rank: int) -> dict:
    from test_offload import Wide

    import autotune

    torch.manual_seed(0)
    plan = autotune.fit(Wide(), torch.randn(4, 96), global_batch_size=8, memory_budget=_share_budget(),
                        device="cpu", cache=False, techniques=("bf16", "offload"), max_trials=8)
    return _flat(plan)


_RUN = {"different-ceilings": _different_ceilings, "partial-offload-share": _partial_offload_share}


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ranks import run_scenarios

    run_scenarios(rank, world, init_file, out_dir, tuple(_RUN), lambda name, r, w: _RUN[name](r))


@pytest.fixture(scope="module")
def plans() -> list[dict]:
    """One pair of ranks runs both fits in turn: the ranks' imports and set-up are paid once."""
    from ranks import spawn

    return spawn(_rank_main, WORLD, TIMEOUT_S)


def _results(plans: list[dict], name: str) -> list[dict]:
    """Each rank's result of scenario `name`, a copy the test may change."""
    results = [copy.deepcopy(p[name]) for p in plans]
    for rank, p in enumerate(results):
        assert p["ok"], f"rank {rank}:\n{p['error']}"
    return results


def test_ranks_with_different_ceilings_agree_on_one_plan(plans):
    plans = _results(plans, "different-ceilings")
    notes = [[t.pop("note") for t in p["trials"]] for p in plans]
    assert plans[0] == plans[1]  # same plan, same trials, same figures on both ranks
    plan = plans[0]
    assert plan["world_size"] == WORLD
    assert plan["micro_batch_size"] * (plan["accumulation_steps"] - 1) + plan["last_micro_batch_size"] == 16 // WORLD
    assert plan["peak_memory_bytes"] <= 0.9 * BUDGETS[1]
    # Where rank 1 failed and rank 0 did not, rank 0 followed it ("another rank ..."). Which micro-batches are
    # tried depends on measured times (a loaded machine re-measures noisy trials), so a run may try none in
    # the 0.5 MiB gap between the ranks; every failed trial is then rank 0's own as well.
    failed = [(t["outcome"], n) for t, n in zip(plans[0]["trials"], notes[0]) if t["outcome"] != "ok"]
    assert failed, "the 2.5 MiB ceiling should have stopped some trial"
    assert all(n.startswith("another rank") or "simulated ceiling" in n or "over the" in n for _, n in failed), notes
    assert plan["memory_budget_bytes"] == min(BUDGETS)
    # Last, the pick's all-reduced step timed both ways (search/reduce_timing.py), one decision on both ranks
    timed = plan["trials"][-1]
    knobs = ("precision", "checkpointing", "offload", "checkpointed_blocks", "compile")
    assert {k: timed["rung"][k] for k in knobs} == {k: plan[k] for k in knobs}, plan["reason"]
    assert timed["sharding"] == ("optimizer_state" if plan["sharding"] == "optimizer_state" else "none")
    assert timed["micro_batch_size"] >= plan["micro_batch_size"]  # the split may balance a last 1 away
    assert "in one after it" in notes[0][-1] or timed["outcome"] != "ok", notes[0][-1]
    assert plan["reduce_overlap"] in (True, False)
    assert ("in one bucket after backward" in plan["reason"]) == (plan["reduce_overlap"] is False), plan["reason"]


def test_replicated_ranks_choose_one_partial_offload_share(plans):
    # Two H100s streamed all of GPT-2 medium's optimizer state each step where a share would have fitted:
    # replicated ranks now choose the share as one process does, together.
    plans = _results(plans, "partial-offload-share")
    for p in plans:
        for t in p["trials"]:
            t.pop("note")
    assert plans[0] == plans[1]  # one share, from the same trials, on both ranks
    plan = plans[0]
    assert plan["world_size"] == WORLD and plan["offload"] == "optimizer"
    assert 0 < plan["offload_fraction"] < 1, plan["reason"]
    assert plan["peak_memory_bytes"] <= 0.9 * _share_budget()
