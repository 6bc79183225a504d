"""`plan.apply` given something that is not a model (or an optimizer that is not one) says so, naming the argument
and the call it expects."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotune


@pytest.fixture(scope="module")
def plan() -> autotune.Plan:
    return autotune.fit(nn.Linear(4, 4), torch.randn(4, 4), device="cpu", memory_budget="64MiB", cache=False,
                        trial_steps=1, techniques=(), loss_fn=lambda m, b: m(b).pow(2).mean())


@pytest.mark.parametrize("model", ["model", None, 3])
def test_apply_given_no_module_names_the_model_argument(plan: autotune.Plan, model: object) -> None:
    expected = rf"plan.apply needs the torch.nn.Module .*got {type(model).__name__}"
    with pytest.raises(autotune.InvalidSetting, match=expected):
        plan.apply(model)


def test_apply_given_the_optimizer_first_says_which_order(plan: autotune.Plan) -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(autotune.InvalidSetting, match=r"got SGD.*plan.apply\(model, optimizer\)"):
        plan.apply(optimizer, model)


@pytest.mark.parametrize("optimizer", ["adam", 3])
def test_apply_given_no_optimizer_names_the_optimizer_argument(plan: autotune.Plan, optimizer: object) -> None:
    with pytest.raises(autotune.InvalidSetting, match=rf"optimizer must be None .*got {type(optimizer).__name__}"):
        plan.apply(nn.Linear(4, 4), optimizer)


def test_apply_of_the_model_still_trains(plan: autotune.Plan) -> None:
    model = nn.Linear(4, 4)
    before = model.weight.detach().clone()
    step = plan.apply(model, loss_fn=lambda m, b: m(b).pow(2).mean())
    try:
        assert torch.isfinite(torch.tensor(step(torch.randn(4, 4))))
    finally:
        step.close()
    assert not torch.equal(before, model.weight.detach())
