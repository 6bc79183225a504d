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

from .offload_link import state_by_position


class EightBitLink:
    """Keeps `user.state_dict()` / `load_state_dict()` on `eight`, the 8-bit optimizer that trains instead."""

    def __init__(self, user: torch.optim.Optimizer, eight: torch.optim.Optimizer) -> None:
        self.user = user
        self.eight = eight
        self._incoming: dict[int, Any] = {}
        if user.state:  # a checkpoint loaded before `apply`: the 8-bit optimizer trains from it
            self._incoming = {k: dict(user.state[p]) for k, p in enumerate(self._params()) if p in user.state}
            self._loaded(user)
            user.state.clear()  # its copy would hold device memory the plan does not count
        self.handles = [user.register_step_pre_hook(self._refuse_step),
                        user.register_state_dict_post_hook(self._state_dict),
                        user.register_load_state_dict_pre_hook(self._loading),
                        user.register_load_state_dict_post_hook(self._loaded)]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _params(self) -> list[nn.Parameter]:
        return [p for group in self.user.param_groups for p in group["params"]]

    def _state_dict(self, optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict["state"] = {k: self.eight.state[p] for k, p in enumerate(self._params()) if self.eight.state.get(p)}
        return state_dict

    def _loading(self, optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        # The user's optimizer loads only its groups; the state goes to the 8-bit optimizer as saved.
        self._incoming = state_by_position(state_dict)
        return {**state_dict, "state": {}}

    def _loaded(self, optimizer: Any) -> None:
        incoming, self._incoming = self._incoming, {}
        params = self._params()
        for k, entry in incoming.items():
            p = params[k]
            # A copy: the 8-bit optimizer steps its state in place, and the loaded dict stays the user's.
            self.eight.state[p] = {name: v.to(p.device, copy=True) if isinstance(v, torch.Tensor) else v
                                   for name, v in entry.items()}

    def _refuse_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        raise RuntimeError("autotune: the plan trains with 8-bit optimizer state in place of this optimizer; step "
                           "through the TrainingStep (loss = step(batch)), not optimizer.step()")
