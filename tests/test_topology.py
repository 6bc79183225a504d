"""The nodes a job spans: read from torchrun's variables, part of the cache key and of the plan, and a plan for
another topology refused with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cache_samples import clean_environment, sample  # noqa: F401 - autouse fixture
from torch import nn

from autotune.cache.key import check_parts
from autotune.cache.rows import check_plan_matches
from autotune.cache.store import PlanCache, key_parts, plan_key
from autotune.configuration import Configuration
from autotune.devices.placement import Placement
from autotune.parallel.topology import Topology, digest, topology
from autotune.plan import Plan

CPU = Placement(kind="cpu", name="cpu (simulated ceiling)", total_bytes=2**34)


def _parts(world: int, nodes: int) -> dict:
    return key_parts(model=nn.Linear(4, 4), batch=torch.zeros(2, 4), global_batch_size=16, world_size=world,
                     placement=CPU, budget_bytes=2**30, techniques=frozenset({"bf16"}), margin=0.1, nodes=nodes)


def test_one_process_is_one_node_of_one_rank() -> None:
    assert topology() == Topology(nodes=1, ranks_per_node=1)
    two = Topology(nodes=2, ranks_per_node=8)
    assert two.world_size == 16 and two.describe() == "2 nodes x 8 ranks"
    assert two.where(9) == "rank 9 (node 1, local rank 1)"


def test_the_key_differs_by_topology_and_one_node_keeps_the_keys_already_cached() -> None:
    one_node, two_nodes = _parts(16, 1), _parts(16, 2)
    assert "nodes" not in one_node  # a one-node key is the one written before nodes were a part
    assert two_nodes["nodes"] == 2
    assert plan_key(one_node) != plan_key(two_nodes) != plan_key(_parts(16, 4))
    check_parts(one_node)
    check_parts(two_nodes)
    with pytest.raises(ValueError, match="parts.nodes 3 does not divide parts.world_size 16"):
        check_parts({**two_nodes, "nodes": 3})
    with pytest.raises(ValueError, match=r"parts.nodes must be an integer >= 2"):
        check_parts({**two_nodes, "nodes": 1})  # one node is written as no part at all


def test_the_plan_records_its_nodes_and_old_rows_still_load() -> None:
    plan, _ = sample()
    old = plan.to_dict()
    del old["config"]["nodes"]  # a row written before the plan knew its nodes
    assert Plan.from_dict(old).config.nodes == 1
    config = Configuration.of(micro_batch_size=2, accumulation_steps=1, world_size=4, global_batch_size=8,
                              last_micro_batch_size=2, memory_budget_bytes=2**30, margin=0.1, sharding="hsdp", nodes=2)
    assert Configuration.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert config.shard_ranks == 2 and config.replace(sharding="fsdp2").shard_ranks == 4
    with pytest.raises(ValueError, match="'hsdp' shards within each node.*1 node: use sharding='fsdp2'"):
        config.replace(nodes=1)
    with pytest.raises(ValueError, match="nodes 3 does not divide world_size 4"):
        config.replace(sharding="fsdp2", nodes=3)


def _plan_for(parts: dict, nodes: int) -> Plan:
    plan, _ = sample()
    return plan.with_config(world_size=16, global_batch_size=16, micro_batch_size=1, accumulation_steps=1,
                            last_micro_batch_size=1, nodes=nodes).with_provenance(key=plan_key(parts))


def test_a_row_for_another_topology_is_refused_with_its_reason() -> None:
    parts = _parts(16, 2)
    check_plan_matches(_plan_for(parts, 2), plan_key(parts), parts)
    with pytest.raises(ValueError, match="plan.nodes is 1 but the key parts say 2"):
        check_plan_matches(_plan_for(parts, 1), plan_key(parts), parts)
    one = _parts(16, 1)
    with pytest.raises(ValueError, match="plan.nodes is 2 but the key parts say 1"):
        check_plan_matches(_plan_for(one, 2), plan_key(one), one)


def test_a_team_row_for_another_topology_is_not_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A teammate's plan tuned on 2 nodes serves 2 nodes only: under one node's key it is not found."""
    two = _parts(16, 2)
    team = tmp_path / "team"
    team.mkdir()
    PlanCache(tmp_path / "alice.db").put(_plan_for(two, 2), two)
    PlanCache(tmp_path / "alice.db").export(team / "alice.jsonl")
    monkeypatch.setenv("AUTOTUNE_TEAM_DIR", str(team))
    bob = PlanCache(tmp_path / "bob.db")
    assert bob.get(plan_key(two)) is not None
    assert bob.get(plan_key(_parts(16, 1))) is None


def test_the_plan_digest_is_the_configuration_s() -> None:
    plan, _ = sample()
    same = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert digest(plan.config.to_dict()) == digest(same.config.to_dict())
    assert digest(plan.config.to_dict()) != digest(plan.config.replace(
        micro_batch_size=2, accumulation_steps=4, last_micro_batch_size=2).to_dict())
