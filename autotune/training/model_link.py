"""The user's model under optimizer offload: its state dict holds the full-precision weights training uses.

Under optimizer offload the device parameters are 16-bit working copies; the FP32 masters live in the
engine's `Shares` (on the host, on the device for its device share, or on another rank under the partitioned
state). Left alone, `model.state_dict()` would save the 16-bit copies and `model.load_state_dict()` would
write only them, to be overwritten by the masters at the next step. `ModelLink` hooks each module that owns
such a parameter, so that a checkpoint saved mid-training holds the masters and one loaded after
`plan.apply` is what the next step trains from, in full precision.

Saved masters are host tensors (the GPU may have no room for an FP32 copy of the model: that is why the plan
offloads). Under the partitioned state, `model.state_dict()` gathers the other ranks' masters: a collective
that every rank must call, as with FSDP's `get_model_state_dict`.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from ..techniques.offload import Shares


class ModelLink:
    """Keeps `model.state_dict()` / `load_state_dict()` on the masters while optimizer offload steps the model
    (`shares`: the engine's masters)."""

    def __init__(self, model: nn.Module, shares: Shares) -> None:
        self.shares = shares
        position = {id(p): i for i, p in enumerate(shares.params)}
        self.handles: list[Any] = []
        for module in model.modules():
            mine = [(name, position[id(p)]) for name, p in module._parameters.items()
                    if p is not None and id(p) in position]
            saved = [(name, i) for name, i in mine if shares.holds_weight(i)]
            loaded = [(name, i) for name, i in mine if shares.has_master(i)]
            if saved:
                self.handles.append(module.register_state_dict_post_hook(functools.partial(self._saved, saved)))
            if loaded:
                self.handles.append(module.register_load_state_dict_pre_hook(functools.partial(self._loading, loaded)))
        if shares.partition is not None and shares.foreign:
            # Every rank gathers once per call at the root, whichever of its modules asks first.
            self.handles.append(model.register_state_dict_pre_hook(lambda *_: shares.gather_weights()))
        # Registered last on the root, so it runs after every module's: the gathered weights are let go.
        self.handles.append(model.register_state_dict_post_hook(lambda *_: shares.forget_weights()))

    def close(self) -> None:
        """Remove the hooks (the offload is undone: the parameters are the weights again)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.shares.forget_weights()

    def _saved(self, owned: list[tuple[str, int]], module: nn.Module, state_dict: dict[str, Any], prefix: str,
               local_metadata: Any) -> None:
        for name, i in owned:
            if prefix + name in state_dict:
                state_dict[prefix + name] = self.shares.weight(i)

    def _loading(self, owned: list[tuple[str, int]], module: nn.Module, state_dict: dict[str, Any], prefix: str,
                 *args: Any) -> None:
        for name, i in owned:
            value = state_dict.get(prefix + name)
            param = module._parameters[name]  # registered: one of the module's own parameters
            if value is not None and param is not None and tuple(value.shape) == tuple(param.shape):
                self.shares.load_weight(i, value)  # a mismatched shape is left to torch's own error
