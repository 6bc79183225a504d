"""The user's optimizer under an 8-bit plan: its state dict is the 8-bit optimizer's, which steps in its place.

An 8-bit plan (`techniques=(..., "optimizer_8bit")`) trains with an 8-bit AdamW built from the user's groups;
the user's optimizer object is not stepped. Left alone, `optimizer.state_dict()` would save its own state,
empty or stale, and a resume would restart the moments from zero. `EightBitLink` makes the user's optimizer
save and load the 8-bit state (in the 8-bit optimizer's own tensors, keyed as the user's optimizer keys its
parameters), and refuse a direct `step()`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .state_hooks import StateHooks


class EightBitLink(StateHooks):
    """Keeps `user.state_dict()` / `load_state_dict()` on `eight`, the 8-bit optimizer that trains instead."""

    _REFUSAL = ("autotune: the plan trains with 8-bit optimizer state in place of this optimizer; step through the "
                "TrainingStep (loss = step(batch)), not optimizer.step()")

    def __init__(self, user: torch.optim.Optimizer, eight: torch.optim.Optimizer) -> None:
        super().__init__(user)
        self.eight = eight
        if user.state:  # a checkpoint loaded before `apply`: the 8-bit optimizer trains from it
            self._take_state({k: dict(user.state[p]) for k, p in enumerate(self._params()) if p in user.state})
            user.state.clear()  # its copy would hold device memory the plan does not count

    def _params(self) -> list[nn.Parameter]:
        return [p for group in self.user.param_groups for p in group["params"]]

    def _saved_state(self) -> dict[int, Any]:
        return {k: self.eight.state[p] for k, p in enumerate(self._params()) if self.eight.state.get(p)}

    def _take_state(self, state: dict[int, Any]) -> None:
        params = self._params()
        for k, entry in state.items():
            p = params[k]
            # A copy: the 8-bit optimizer steps its state in place, and the loaded dict stays the user's.
            self.eight.state[p] = {name: v.to(p.device, copy=True) if isinstance(v, torch.Tensor) else v
                                   for name, v in entry.items()}
