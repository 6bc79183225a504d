"""The recovery policy (what failed -> the next configuration) and who is told, without training anything."""

from __future__ import annotations

import dataclasses

from test_step import make_plan, new_model, peak_of, run_plan, seq_batch

from autotune.configuration import Rung
from autotune.techniques.offload import NO_OFFLOAD, offload_of
from autotune.training import recovery
from autotune.training.learned import Learned

LADDER = [Rung(precision="fp32"), Rung(precision="fp32", checkpointing="full"),
          Rung(precision="fp32", checkpointing="full", offload="optimizer")]


def test_an_oom_halves_the_micro_batch_then_climbs_then_gives_up():
    plan = make_plan(4, 8)
    halved = recovery.after_oom(plan, LADDER)
    assert (halved.micro_batch_size, halved.accumulation_steps, halved.rung) == (2, 4, plan.rung)
    at_one = recovery.after_oom(recovery.after_oom(halved, LADDER), LADDER)
    assert at_one.micro_batch_size == 1 and at_one.rung == LADDER[1]  # micro-batch 1 failed: the next rung up
    top = make_plan(1, 8).with_config(checkpointing="full", offload="optimizer", offload_fraction=None)
    assert recovery.after_oom(top, LADDER) is None  # nothing higher allowed


def test_climbing_to_optimizer_offload_leaves_the_sharded_optimizer_state():
    plan = make_plan(1, 8).with_config(checkpointing="full", checkpointed_blocks=None,
                                       sharding="optimizer_state", world_size=2, global_batch_size=16)
    climbed = recovery.after_oom(plan, LADDER)
    assert climbed.rung.offload == "optimizer" and climbed.sharding == "none" and climbed.offload_fraction == 1.0
    assert (plan.rung.offload, plan.sharding, recovery.host_share(plan)) == ("none", "optimizer_state", 1.0)
    assert recovery.host_share(climbed) == 1.0


def test_climbing_to_activation_offload_leaves_the_sharded_optimizer_state_too():
    # The partitioned state keeps no offload beside it: any offloading rung leaves it, not only the optimizer's.
    plan = make_plan(1, 8).with_config(checkpointing="full", checkpointed_blocks=None,
                                       sharding="optimizer_state", world_size=2, global_batch_size=16)
    up = Rung(precision="fp32", checkpointing="full", offload="activations")
    climbed = recovery.after_oom(plan, [*LADDER[:2], up])
    assert (climbed.rung, climbed.sharding) == (up, "none")


def test_a_recovery_is_reported_to_the_callback_kept_with_the_plan_only():
    model = new_model()
    budget = peak_of(make_plan(2, 8), model, seq_batch(8, 32))
    seen = []
    reporter = lambda old, new, note, shapes: seen.append((old.key, new.micro_batch_size, note, shapes))  # noqa: E731
    told = dataclasses.replace(make_plan(4, 8, budget=budget, key="k"), learned=Learned.of(loss_fn=None,
                                                                                           report=reporter))
    _, step, _ = run_plan(told, model, [seq_batch(8, 32)])
    _, other, _ = run_plan(make_plan(4, 8, budget=budget, key="k"), new_model(), [seq_batch(8, 32)])
    assert step.recoveries and other.recoveries
    assert [s[0] for s in seen] == ["k"] * len(step.recoveries)  # the same key without the callback: not told
    assert seen[-1][1] == step.plan.micro_batch_size and seen[0][3] and "out of memory" in seen[0][2].lower()


def test_no_offload_answers_the_interface_with_nothing():
    assert offload_of(object()) is NO_OFFLOAD and not NO_OFFLOAD.engaged
    assert NO_OFFLOAD.abort() == set() and NO_OFFLOAD.keep_stepped({1, 2}) == set()
