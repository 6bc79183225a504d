"""`plan.apply` trains with the loss function `fit` tuned with; without one, the error says where it goes."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import autotune

BATCH = (torch.randn(8, 8), torch.randint(0, 3, (8,)))


def cross_entropy(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs), labels)


def classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def tune(model: nn.Module, batch: Any = BATCH, **kwargs: Any) -> autotune.Plan:
    return autotune.fit(model, batch, device="cpu", memory_budget="64MiB", cache=False, trial_steps=1,
                        max_trials=2, techniques=(), progress=False, **kwargs)


def test_apply_trains_with_the_loss_fn_fit_was_given() -> None:
    model = classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = tune(model, optimizer=optimizer, loss_fn=cross_entropy)
    expected = float(cross_entropy(model, BATCH).detach())
    with plan.apply(model, optimizer) as step:
        assert step(BATCH) == pytest.approx(expected, rel=1e-5)  # the loss before the step, over the whole batch


def test_the_loss_fn_travels_with_the_plan_object_fit_returned() -> None:
    plan = tune(classifier(), loss_fn=cross_entropy)
    other = classifier()  # another copy of the model: the plan fit returned trains it with fit's loss too
    expected = float(cross_entropy(other, BATCH).detach())
    with plan.apply(other, torch.optim.SGD(other.parameters(), lr=0.1)) as step:
        assert step(BATCH) == pytest.approx(expected, rel=1e-5)
    assert plan == autotune.Plan.from_dict(plan.to_dict())  # not part of its equality, nor of its dict form


def test_a_plan_read_back_from_its_dict_says_to_pass_loss_fn_to_apply() -> None:
    model = classifier()
    plan = autotune.Plan.from_dict(tune(model, loss_fn=cross_entropy).to_dict())  # as the cache serves it
    with plan.apply(model, torch.optim.SGD(model.parameters(), lr=0.1)) as step:
        with pytest.raises(autotune.InvalidSetting,
                           match=r"Sequential.forward does not take.*pass it to plan\.apply\(model, optimizer, "
                                 r"loss_fn=\.\.\.\)"):
            step(BATCH)


def test_fit_without_a_loss_it_can_find_says_to_pass_loss_fn_to_fit() -> None:
    with pytest.raises(autotune.InvalidSetting, match=r"no scalar loss.*pass it to autotune\.fit\(model, batch, "
                                                      r"loss_fn=\.\.\.\)"):
        autotune.fit(classifier(), BATCH[0], device="cpu", memory_budget="64MiB", cache=False, progress=False)


class SquareLoss(nn.Module):
    """A model whose output is its own loss, with a method that doubles it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).pow(2).mean()

    def doubled(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return 2 * model(batch)


def test_fit_without_loss_fn_forgets_the_one_an_earlier_fit_was_given() -> None:
    model, batch = SquareLoss(), torch.randn(8, 8)
    tune(model, batch, loss_fn=lambda m, b: 2 * m(b))
    plan = tune(model, batch)
    expected = float(model(batch).detach())
    with plan.apply(model, torch.optim.SGD(model.parameters(), lr=0.1)) as step:
        assert step(batch) == pytest.approx(expected, rel=1e-5)


def test_a_loss_fn_that_is_the_models_own_method_does_not_keep_the_model_alive() -> None:
    model, batch = SquareLoss(), torch.randn(8, 8)
    plan = tune(model, batch, loss_fn=model.doubled)
    expected = 2 * float(model(batch).detach())
    with plan.apply(model, torch.optim.SGD(model.parameters(), lr=0.1)) as step:
        assert step(batch) == pytest.approx(expected, rel=1e-5)
    gone = weakref.ref(model)
    del model, step
    gc.collect()
    assert gone() is None
