"""The user's optimizer when another optimizer steps in its place: its state dict saves and loads the other's state.

A plan that steps an optimizer of its own (an 8-bit one, the offload's `HostOptimizer`) leaves the user's
optimizer object unstepped. `StateHooks` hooks that object so that `optimizer.state_dict()` saves the state that
trains, `optimizer.load_state_dict()` hands a checkpoint's state to it as saved (torch would cast it to each
parameter's dtype first), and a direct `optimizer.step()` is refused. A subclass says where the state lives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch


class StateHooks(ABC):
    """The hooks on `user`, the optimizer the plan steps in place of; removed by `close()`.

    Both sides of a state dict key each parameter's state by its position in the user's groups
    (`state_by_position`), the numbering a saved state dict uses.
    """

    _REFUSAL: ClassVar[str]  # what a direct `optimizer.step()` raises: why it is refused and what to call instead

    def __init__(self, user: torch.optim.Optimizer) -> None:
        self.user = user
        self._incoming: dict[int, Any] = {}  # a loaded state dict's state, taken before torch casts it
        self.handles = [user.register_step_pre_hook(self._refuse_step),
                        user.register_state_dict_post_hook(self._state_dict),
                        user.register_load_state_dict_pre_hook(self._loading),
                        user.register_load_state_dict_post_hook(self._loaded)]

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    @abstractmethod
    def _saved_state(self) -> dict[int, Any]:
        """The state that trains, keyed by position in the user's groups: what `optimizer.state_dict()` saves."""

    @abstractmethod
    def _take_state(self, state: dict[int, Any]) -> None:
        """Put a loaded state dict's state, keyed by position and as saved, where the state trains."""

    def _refuse_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        raise RuntimeError(self._REFUSAL)

    def _state_dict(self, optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict["state"] = self._saved_state()
        return state_dict

    def _loading(self, optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        # The user's optimizer loads only its groups; the state goes where it trains, as saved (`_loaded`).
        self._incoming = state_by_position(state_dict)
        return {**state_dict, "state": {}}

    def _loaded(self, optimizer: Any) -> None:
        incoming, self._incoming = self._incoming, {}
        self._take_state(incoming)


def state_by_position(state_dict: dict[str, Any]) -> dict[int, Any]:
    """An optimizer state dict's per-parameter state keyed by position in its groups: a saved dict names its
    parameters by its own ids, listed in group order."""
    saved = [pid for group in state_dict.get("param_groups", []) for pid in group["params"]]
    state = state_dict.get("state", {})
    return {k: state[pid] for k, pid in enumerate(saved) if pid in state}
