"""Plan and Trial validate themselves and round-trip through dicts."""

from __future__ import annotations

import json

import pytest

from autotune.configuration import Rung

from autotune.evidence import Trial

from autotune.plan import Plan


def _plan(**over):
    fields = dict(precision="bf16", checkpointing="full", offload="none", micro_batch_size=10, accumulation_steps=7,
                  world_size=1, global_batch_size=64, last_micro_batch_size=4, peak_memory_bytes=10, margin=0.1,
                  memory_budget_bytes=100, samples_per_second=5.0, reason="r",
                  trials=(Trial(rung=Rung(checkpointing="full"), micro_batch_size=10, outcome="ok"),))
    fields.update(over)
    return Plan(**fields)


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
    del older["reduce_overlap"]  # a row stored before the field existed: the buckets, as it trained then
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
