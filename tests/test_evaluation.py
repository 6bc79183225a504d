"""A checking forward leaves no trace (`workload/evaluation.py`): flags, buffers, random streams and parameters
written in place by the forward are as before; parameters nothing writes are never copied."""

from __future__ import annotations

import torch
from torch import nn

from autotune.workload.evaluation import _FirstValues, evaluating


class Renormed(nn.Module):
    """A max-norm constraint applied in forward: the weight renormalized in place, and a step counter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.kept = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin.weight.data.renorm_(2, 0, 0.1)
        self.calls += 1
        return self.kept(self.lin(torch.nn.functional.dropout(x, 0.5, self.training)))


def test_a_forward_that_writes_a_parameter_in_place_leaves_it_as_it_was():
    model = Renormed().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with evaluating(model):
        model(torch.ones(2, 4))
        assert not model.training
        assert float(model.lin.weight.norm(dim=1).max()) <= 0.1 + 1e-6  # the write happened inside
    assert model.training and torch.equal(torch.get_rng_state(), rng)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_only_the_parameters_written_are_copied():
    model = Renormed()
    guard = _FirstValues(list(model.parameters()))
    with torch.no_grad(), guard:
        model(torch.ones(2, 4))
        model(torch.ones(2, 4))
    assert [p for p, _ in guard.saved.values()] == [model.lin.weight]
    guard.put_back()
    assert not guard.saved
