"""With several ranks, replicated and sharded plans are both measured where sharding could win, and the faster
is kept: which one wins is decided on the two plans' measured throughput."""

from __future__ import annotations

import pytest
import torch

from autotune.errors import NoFeasiblePlan
from autotune.evidence import Finding
from autotune.plan import Plan
from autotune.search.sharding_choice import searched_beside
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
    assert kept.sharding == "none" and kept.evidence.account == "measured"
    (found,) = kept.findings
    assert (found.kind, found.subject, found.place) == ("sharding", "replicated", "before")
    assert found.figures == pytest.approx({"samples_per_second": 100.0, "ratio": 1.25,
                                           "other_samples_per_second": 80.0})
    tie = replicated_or_sharded(_plan(100.0), _plan(101.0, sharding="fsdp2"))
    assert tie.sharding == "none"  # within noise: nothing to shard for
    assert tie.findings[0].figures["other_samples_per_second"] == 101.0


def test_a_second_search_that_finds_nothing_or_fails_leaves_the_plan_with_a_finding() -> None:
    plan = _plan(100.0)

    def nothing() -> Plan:
        raise NoFeasiblePlan("nothing fits under the budget")

    def broken() -> Plan:
        raise RuntimeError("an op this device lacks\nmore")

    found, kept = searched_beside(plan, "sharded with FSDP2", nothing)
    assert found is None and kept.config == plan.config
    assert kept.findings == (Finding(kind="nothing fits", clause="sharded with FSDP2: nothing fits",
                                     subject="sharded with FSDP2"),)
    assert kept.reason == "measured; sharded with FSDP2: nothing fits"  # the one test of this clause's wording
    found, kept = searched_beside(plan, "hybrid sharding", broken)
    assert found is None and [(f.kind, f.subject) for f in kept.findings] == [("search failed", "hybrid sharding")]
    assert kept.reason == "measured; hybrid sharding: RuntimeError: an op this device lacks"


def test_a_sharded_search_runs_only_where_the_replicated_plan_spends_time_on_memory() -> None:
    model = torch.nn.Linear(4, 4)
    assert sharding_may_win(_plan(100.0), model, world=2)  # every block recomputed
    assert sharding_may_win(_plan(100.0, checkpointing="none", offload="optimizer"), model, world=2)
    assert not sharding_may_win(_plan(100.0, checkpointing="none"), model, world=2)  # nothing to free
    assert not sharding_may_win(_plan(100.0), model, world=1)  # nothing to shard over
    assert not sharding_may_win(_plan(100.0, sharding="fsdp2"), model, world=2)  # sharded already
