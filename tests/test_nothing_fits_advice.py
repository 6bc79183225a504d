"""When nothing fits, the advice asks only for techniques the search left out, never for those it used."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotune


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def _nothing_fits(techniques: tuple[str, ...]) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), Block(), Block(), nn.Linear(256, 1))  # blocks to recompute
    with pytest.raises(autotune.NoFeasiblePlan, match="no configuration fits") as err:
        autotune.fit(model, torch.randn(8, 64), global_batch_size=8, device="cpu", memory_budget="100KiB",
                     cache=False, trial_steps=1, techniques=techniques, loss_fn=lambda m, b: m(b).square().mean())
    return str(err.value)


def test_advice_after_every_technique_was_searched_asks_for_none() -> None:
    message = _nothing_fits(("bf16", "checkpointing", "offload"))
    assert "techniques" not in message.rsplit(".", 2)[-2], message
    assert message.endswith("Raise memory_budget, or shrink the model or the sequence."), message


def test_advice_names_only_the_techniques_left_out() -> None:
    message = _nothing_fits(("checkpointing",))
    assert "allow bf16 and offload (add 'bf16', 'offload' to fit's techniques)" in message, message
    assert "'checkpointing'" not in message.rsplit("Tried:", 1)[1].split("Raise", 1)[1], message
