"""The user's optimizer under optimizer offload: kept consistent with the `HostOptimizer` that replaced it.

Under the optimizer-offload rung, `apply_rung` builds a `HostOptimizer` from the user's optimizer (its
class, hyperparameters and state) and steps that instead. Left alone, the user's optimizer object would go
stale without a word: its state frozen at the switch (and still holding device memory the rung is meant
to free), an LR scheduler writing to groups nobody reads, a checkpoint of `optimizer.state_dict()`
saving old moments. `OffloadLink` prevents each of these with the optimizer's public hooks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..techniques.offload import HostOptimizer


class OffloadLink:
    """Keeps the user's optimizer consistent while its state lives in a `HostOptimizer`.

    Parameters pair up by position: the HostOptimizer's groups are the user's groups in order, trainable
    parameters only (`OptimizerSpec.from_user`), so the k-th trainable parameter of the user's groups
    owns the k-th master.
    """

    _NOT_COPIED = ("params", "fused", "foreach", "capturable", "differentiable")

    def __init__(self, user: torch.optim.Optimizer, host: HostOptimizer) -> None:
        self.user = user
        self.host = host.optimizer  # held here: HostOptimizer.restore() lets go of it before close()
        self.groups = [g for g in user.param_groups if any(p.requires_grad for p in g["params"])]
        masters = [m for g in self.host.param_groups for m in g["params"]]
        self.pairs: list[tuple[int, nn.Parameter, torch.Tensor]] = []  # (user state_dict index, param, master)
        index = 0
        for group in user.param_groups:
            for p in group["params"]:
                if p.requires_grad and len(self.pairs) < len(masters):
                    self.pairs.append((index, p, masters[len(self.pairs)]))
                index += 1
        user.state.clear()  # apply_rung copied it to the host; dropping it frees the device memory
        self.handles = [user.register_step_pre_hook(self._refuse_step),
                        user.register_state_dict_post_hook(self._state_dict),
                        user.register_load_state_dict_post_hook(self._loaded)]

    def sync_hyperparameters(self) -> None:
        """Copy lr, betas, weight decay... from the user's groups (an LR scheduler writes there)."""
        for mine, theirs in zip(self.groups, self.host.param_groups):
            for key, value in mine.items():
                if key not in self._NOT_COPIED and key in theirs:
                    theirs[key] = value

    def close(self) -> None:
        """Remove the hooks and load the host state back into the user's optimizer.

        Call it after the offload is undone: `load_state_dict` casts the state to each parameter's
        device and dtype, which are the FP32 device weights again by then.
        """
        for handle in self.handles:
            handle.remove()
        self.handles = []
        state = self._state_dict(self.user, self.user.state_dict())
        self.user.load_state_dict(state)
        self.host = None  # type: ignore[assignment]
        self.pairs = []

    def _refuse_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        raise RuntimeError("autotune: this optimizer's state lives on the host under the plan's optimizer "
                           "offload; step through the TrainingStep (loss = step(batch)), not optimizer.step(). "
                           "step.close() hands the state back.")

    def _state_dict(self, optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        host_state = self.host.state
        state_dict["state"] = {i: host_state[m] for i, _, m in self.pairs if m in host_state}
        return state_dict

    def _loaded(self, optimizer: Any) -> None:
        # The user loaded a checkpoint into their optimizer: move it into the host optimizer.
        host_sd = self.host.state_dict()
        host_sd["state"] = {k: self.user.state[p] for k, (_, p, _) in enumerate(self.pairs) if p in self.user.state}
        self.host.load_state_dict(host_sd)
        self.user.state.clear()
        self.sync_hyperparameters()
