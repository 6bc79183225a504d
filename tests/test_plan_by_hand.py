"""`Plan.of` as the README shows it: a plan written by hand from the fields a user knows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotune


def test_a_plan_written_with_the_fields_a_user_knows_fills_in_the_rest() -> None:
    plan = autotune.Plan.of(precision="bf16", checkpointing="full", micro_batch_size=8, global_batch_size=64,
                            memory_budget_bytes=24 * 2**30)
    assert (plan.accumulation_steps, plan.world_size, plan.last_micro_batch_size) == (8, 1, 8)
    assert plan.margin == 0.1 and plan.peak_memory_bytes == 0 and plan.samples_per_second == 0
    assert plan.summary() == ("bf16+full ckpt, micro-batch 8 x 8 accumulation x 1 rank(s) = 64; not measured; "
                              "budget 24.00 GiB")
    assert autotune.Plan.from_dict(plan.to_dict()) == plan


def test_accumulation_steps_give_the_global_batch_and_an_uneven_split_its_last_micro_batch() -> None:
    assert autotune.Plan.of(micro_batch_size=4, accumulation_steps=3, memory_budget_bytes=2**30).global_batch_size == 12
    uneven = autotune.Plan.of(micro_batch_size=3, global_batch_size=8, memory_budget_bytes=2**30)
    assert (uneven.accumulation_steps, uneven.last_micro_batch_size) == (3, 2)


def test_a_missing_field_is_named_with_an_example() -> None:
    with pytest.raises(autotune.InvalidSetting,
                       match=r"Plan.of\(\) needs memory_budget_bytes, global_batch_size \(or accumulation_steps\)"):
        autotune.Plan.of(precision="bf16", micro_batch_size=8)


def test_a_hand_written_plan_trains() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = autotune.Plan.of(precision="fp32", micro_batch_size=2, global_batch_size=4, memory_budget_bytes=2**30,
                            device="cpu")
    step = plan.apply(model, optimizer, loss_fn=lambda m, b: m(b).square().mean())
    assert step(torch.randn(4, 4)) >= 0
