"""With several ranks, replicated and sharded plans are both measured where sharding could win, and the faster
is kept: which one wins is decided on the two plans' measured throughput."""

from __future__ import annotations

import torch

from autotune.plan import Plan
from autotune.search.tune import replicated_or_sharded, sharding_may_win


def _plan(samples_per_second: float, *, sharding: str = "none", checkpointing: str = "full",
          offload: str = "none") -> Plan:
    return Plan.of(precision="bf16", checkpointing=checkpointing, checkpointed_blocks=4 if checkpointing == "full"
                   else 0, offload=offload, micro_batch_size=4, accumulation_steps=4, world_size=2,
                   global_batch_size=32, last_micro_batch_size=4, peak_memory_bytes=10, margin=0.1,
                   memory_budget_bytes=100, samples_per_second=samples_per_second, reason="measured",
                   sharding=sharding, device="cuda", device_name="a GPU", source="tuned")


def test_sharded_wins_where_it_measured_faster() -> None:
    kept = replicated_or_sharded(_plan(100.0), _plan(180.0, sharding="fsdp2", checkpointing="none"))
    assert kept.sharding == "fsdp2" and kept.checkpointing == "none"
    assert kept.reason.startswith("sharded with FSDP2: 180.0 samples/s, 1.80x the replicated plan's 100.0")
    assert kept.reason.endswith("; measured")


def test_replicated_wins_where_it_measured_faster_or_within_noise() -> None:
    kept = replicated_or_sharded(_plan(100.0), _plan(80.0, sharding="fsdp2"))
    assert kept.sharding == "none" and kept.reason.startswith("replicated: 100.0 samples/s, 1.25x the sharded")
    tie = replicated_or_sharded(_plan(100.0), _plan(101.0, sharding="fsdp2"))
    assert tie.sharding == "none"  # within noise: nothing to shard for


def test_a_sharded_search_runs_only_where_the_replicated_plan_spends_time_on_memory() -> None:
    model = torch.nn.Linear(4, 4)
    assert sharding_may_win(_plan(100.0), model, world=2)  # every block recomputed
    assert sharding_may_win(_plan(100.0, checkpointing="none", offload="optimizer"), model, world=2)
    assert not sharding_may_win(_plan(100.0, checkpointing="none"), model, world=2)  # nothing to free
    assert not sharding_may_win(_plan(100.0), model, world=1)  # nothing to shard over
    assert not sharding_may_win(_plan(100.0, sharding="fsdp2"), model, world=2)  # sharded already
