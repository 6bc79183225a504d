"""Plan, its parts and Trial validate themselves and round-trip through dicts."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autotune.configuration import Configuration, Rung
from autotune.evidence import Evidence, Finding, Provenance, Trial
from autotune.plan import PLAN_FORMAT_VERSION, Plan, StalePlanFormat


def _plan(**over):
    fields = dict(precision="bf16", checkpointing="full", offload="none", micro_batch_size=10, accumulation_steps=7,
                  world_size=1, global_batch_size=64, last_micro_batch_size=4, peak_memory_bytes=10, margin=0.1,
                  memory_budget_bytes=100, samples_per_second=5.0, reason="r",
                  trials=(Trial(rung=Rung(checkpointing="full"), micro_batch_size=10, outcome="ok"),))
    fields.update(over)
    return Plan.of(**fields)


def test_round_trip_through_json():
    plan = _plan()
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    assert again.trials[0].rung == Rung(checkpointing="full")


@pytest.mark.parametrize("over,match", [
    ({"micro_batch_size": -1}, "micro_batch_size"),
    ({"precision": "int8"}, "precision"),
    ({"accumulation_steps": 6}, "covers 54 samples"),
    ({"global_batch_size": 63, "world_size": 2}, "does not divide"),
    ({"margin": 1.5}, "margin"),
])
def test_bad_values_are_rejected(over, match):
    with pytest.raises(ValueError, match=match):
        _plan(**over)


def test_unknown_fields_are_rejected():
    d = _plan().to_dict()
    d["evil"] = "__import__('os')"
    with pytest.raises(ValueError, match="unknown Plan field"):
        Plan.from_dict(d)


def test_the_optimizer_state_sharded_over_ranks_is_a_plan_of_several_replicated_ranks_only():
    two = dict(sharding="optimizer_state", world_size=2, global_batch_size=128, accumulation_steps=7,
               micro_batch_size=10, last_micro_batch_size=4)
    plan = _plan(**two)
    assert plan.partitioned_state and not _plan(**{**two, "sharding": "none"}).partitioned_state
    assert "optimizer state sharded over 2 ranks" in plan.summary()
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    for over in ({"world_size": 1, "global_batch_size": 64}, {"offload": "optimizer"}, {"precision": "fp16"}):
        with pytest.raises(ValueError, match="partitions the optimizer state over replicated ranks"):
            _plan(**{**two, **over})
    with pytest.raises(ValueError, match="use sharding='optimizer_state'"):  # the old spelling is not misread
        _plan(**{**two, "sharding": "none", "offload": "optimizer", "offload_fraction": 0.0})
    with pytest.raises(ValueError, match="only optimizer offload puts a share"):
        _plan(offload="none", offload_fraction=0.5)


def test_when_the_gradient_all_reduce_runs_is_a_choice_of_several_replicated_ranks_only():
    two = dict(world_size=2, global_batch_size=128)
    after = _plan(**two, reduce_overlap=False)
    assert "gradients all-reduced after backward" in after.summary()
    assert "all-reduced" not in _plan(**two, reduce_overlap=True).summary()
    assert Plan.from_dict(json.loads(json.dumps(after.to_dict()))) == after
    older = after.to_dict()
    del older["config"]["reduce_overlap"]  # a row stored before the field existed: the buckets, as it trained then
    assert Plan.from_dict(older).reduce_overlap is None
    for over in ({"world_size": 1, "global_batch_size": 64}, {"sharding": "fsdp2"}):
        with pytest.raises(ValueError, match="reduce_overlap False times the gradient all-reduce of replicated ranks"):
            _plan(**{**two, **over}, reduce_overlap=False)
    with pytest.raises(ValueError, match="reduce_overlap must be True, False or None"):
        _plan(**two, reduce_overlap="after")
    timed = Trial(rung=Rung(), micro_batch_size=2, outcome="ok", reduce_seconds=0.01, reduce_after_seconds=0.02)
    assert Trial.from_dict(json.loads(json.dumps(timed.to_dict()))) == timed
    with pytest.raises(ValueError, match="reduce_after_seconds"):
        Trial(rung=Rung(), micro_batch_size=2, outcome="ok", reduce_after_seconds=-1.0)


def test_a_plan_is_a_configuration_with_its_evidence_and_provenance():
    plan = _plan(key="k" * 64, device="cpu")
    assert isinstance(plan.config, Configuration) and isinstance(plan.evidence, Evidence)
    assert isinstance(plan.provenance, Provenance) and not hasattr(plan, "cache")
    assert (plan.precision, plan.rung, plan.micro_batch_size, plan.per_rank_batch_size) == \
        ("bf16", Rung(checkpointing="full"), 10, 64)
    assert (plan.reason, plan.key, plan.source, plan.device, plan.format_version) == \
        ("r", "k" * 64, "tuned", "cpu", PLAN_FORMAT_VERSION)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.config = plan.config  # frozen: a change is a new plan (`with_config`)
    with pytest.raises((AttributeError, TypeError)):  # the frozen dataclass refuses any attribute
        plan.micro_batch_size = 2
    d = plan.to_dict()
    assert set(d) == {"config", "evidence", "provenance"} and d["provenance"]["format_version"] == 3
    assert d["config"]["rung"]["checkpointing"] == "full" and d["evidence"]["reason"] == "r"
    with pytest.raises(TypeError, match="unexpected field 'cache'"):
        _plan(cache=None)


def test_with_config_evidence_and_provenance_change_one_part_each():
    plan = _plan()
    smaller = plan.with_config(micro_batch_size=8, accumulation_steps=8, last_micro_batch_size=8, offload="optimizer"
                               ).with_finding(Finding(kind="recovered", clause="recovered", place="instead"))
    assert (smaller.micro_batch_size, smaller.offload, smaller.offload_fraction, smaller.reason) == \
        (8, "optimizer", 1.0, "recovered")
    assert smaller.evidence.trials == plan.trials and smaller.provenance == plan.provenance
    assert plan.with_config(smaller.config).config == smaller.config
    assert plan.with_config(smaller.config).reason == "r"
    assert plan.with_evidence(mfu=0.5).mfu == 0.5 and plan.with_provenance(source="cache").source == "cache"
    with pytest.raises(ValueError, match="disagree"):
        plan.with_config(micro_batch_size=8)  # the split must still cover the batch
    with pytest.raises(ValueError, match="Provenance.source"):
        plan.with_provenance(source="elsewhere")


def test_a_plan_of_another_format_is_stale_never_misread():
    flat = {"precision": "bf16", "checkpointing": "none", "offload": "none", "micro_batch_size": 8,
            "accumulation_steps": 1, "world_size": 1, "global_batch_size": 8, "last_micro_batch_size": 8,
            "peak_memory_bytes": 10, "memory_budget_bytes": 100, "margin": 0.1, "samples_per_second": 1.0,
            "format_version": 2}  # as autotune wrote plans before they had parts
    with pytest.raises(StalePlanFormat, match="plan format version 2 is not 3"):
        Plan.from_dict(flat)
    shown = Plan.from_flat_dict(flat)  # read for display (`autotune plot` of an older record), never cached
    assert (shown.micro_batch_size, shown.format_version, shown.offload_fraction) == (8, 2, 0.0)
    with pytest.raises(ValueError, match="unexpected field 'speedup'"):
        Plan.from_flat_dict({**flat, "speedup": 2.0})
    newer = _plan().to_dict()
    newer["provenance"]["format_version"] = 4
    with pytest.raises(ValueError, match="plan format version 4 is not 3"):
        Plan.from_dict(newer)
    with pytest.raises(ValueError, match="unknown Configuration field"):
        Plan.from_dict({**_plan().to_dict(), "config": {**_plan().config.to_dict(), "cache": None}})
