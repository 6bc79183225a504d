"""On several nodes, flat FSDP2 and hybrid sharding are both measured and the faster kept, the reason naming both
rates and the all-reduce across nodes as timed."""

from __future__ import annotations

import pytest

from autotune.plan import Plan
from autotune.search.sharding_choice import flat_or_hybrid


def _plan(samples_per_second: float, sharding: str) -> Plan:
    return Plan.of(precision="bf16", micro_batch_size=4, accumulation_steps=1, world_size=16, nodes=2,
                   global_batch_size=64, last_micro_batch_size=4, peak_memory_bytes=10, margin=0.1,
                   memory_budget_bytes=100, samples_per_second=samples_per_second, reason="measured",
                   sharding=sharding, device="cuda", device_name="a GPU", source="tuned")


def test_a_slow_link_between_nodes_picks_hybrid_sharding() -> None:
    kept = flat_or_hybrid(_plan(100.0, "fsdp2"), _plan(180.0, "hsdp"), link_seconds=0.0125, shard_bytes=2**20)
    assert kept.sharding == "hsdp" and kept.config.nodes == 2
    assert kept.reason.startswith("hybrid sharding (over the 8 ranks of each of 2 nodes, replicated across): 180.0 "
                                  "samples/s, 1.80x the flat plan's 100.0; the all-reduce of a rank's 1.0 MiB gradient "
                                  "shard across nodes measured 12.5 ms; measured"), kept.reason


def test_a_fast_link_or_a_tie_keeps_flat_sharding() -> None:
    kept = flat_or_hybrid(_plan(150.0, "fsdp2"), _plan(100.0, "hsdp"), link_seconds=0.001, shard_bytes=2**20)
    assert kept.sharding == "fsdp2" and kept.evidence.account == "measured"
    (found,) = kept.findings
    assert (found.kind, found.subject, found.place) == ("hybrid", "flat", "before")
    assert found.figures == pytest.approx({"samples_per_second": 150.0, "ratio": 1.5, "other_samples_per_second": 100.0,
                                           "link_seconds": 0.001, "shard_bytes": 2**20})
    assert flat_or_hybrid(_plan(100.0, "fsdp2"), _plan(101.0, "hsdp"), link_seconds=0.001,
                          shard_bytes=2**20).sharding == "fsdp2"  # within noise: fewer bytes per rank
