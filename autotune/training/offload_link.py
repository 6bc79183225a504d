"""The user's optimizer under optimizer offload: kept consistent with the engine that replaced it.

Under the optimizer-offload rung, `apply_rung` builds an engine (a `HostOptimizer`) from the user's optimizer (its
class, hyperparameters and state) and steps that instead. Left alone, the user's optimizer object would go
stale without a word: its state frozen at the switch (and still holding device memory the rung is meant
to free), an LR scheduler writing to groups nobody reads, a checkpoint of `optimizer.state_dict()`
saving old moments. `OffloadLink` prevents each of these with the optimizer's public hooks.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ..devices.shards import is_shard
from ..errors import is_oom
from ..sizes import format_bytes
from ..techniques.offload import Shares
from .state_hooks import StateHooks

log = logging.getLogger(__name__)


def _empty_device_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class OffloadLink(StateHooks):
    """Keeps the user's optimizer consistent while its state lives in an engine's `Shares`.

    Parameters pair up by position: the k-th trainable parameter of the user's groups owns the k-th entry
    of `Shares.owners()` (a host master, or under partial offload the parameter itself, stepped by
    the device share's optimizer).
    """

    _NOT_COPIED = ("params", "fused", "foreach", "capturable", "differentiable")
    _REFUSAL = ("autotune: this optimizer's state lives on the host under the plan's optimizer offload; step through "
                "the TrainingStep (loss = step(batch)), not optimizer.step(). step.close() hands the state back.")

    def __init__(self, user: torch.optim.Optimizer, shares: Shares) -> None:
        super().__init__(user)
        self.shares: Shares | None = shares
        owners = shares.owners()  # held here: the engine's restore() lets go of its optimizers before close()
        self.pairs: list[tuple[int, nn.Parameter, torch.optim.Optimizer, torch.Tensor]] = []
        index = 0
        for group in user.param_groups:
            for p in group["params"]:
                if p.requires_grad and len(self.pairs) < len(owners):
                    self.pairs.append((index, p, *owners[len(self.pairs)]))
                index += 1
        user.state.clear()  # apply_rung copied it to the host; dropping it frees the device memory
        self.mirror()

    def mirror(self) -> None:
        """The user's `optimizer.state` holds the host state itself (the same dicts, no copy): what it reports
        is what trains, and code that reads it to see whether the state exists (torch's distributed checkpoint
        API steps an optimizer whose state is empty to build one, which the offload refuses) sees that it does. Called
        after each step and each load, which may create or replace the host's entries."""
        self.user.state.clear()
        for _, p, opt, key in self.pairs:
            if isinstance(opt, torch.optim.Optimizer):  # not another rank's, gathered only for a state dict
                self.user.state[p] = opt.state[key]  # (a defaultdict: an empty entry until the first step fills it)

    def sync_hyperparameters(self) -> None:
        """Copy lr, betas, weight decay... from the user's groups (an LR scheduler writes there)."""
        if self.shares is not None:
            self.shares.sync_hyperparameters(self.user.param_groups, self._NOT_COPIED)

    def close(self) -> None:
        """Remove the hooks and load the host state back into the user's optimizer.

        Call it after the offload is undone: `load_state_dict` casts the state to each parameter's
        device and dtype, which are the FP32 device weights again by then.
        """
        super().close()
        state = self._state_dict(self.user, self.user.state_dict())
        try:
            self.user.load_state_dict(state)
        except Exception as exc:  # only an OOM is handled; anything else propagates
            if not is_oom(exc):
                raise
            self._keep_on_host(exc)
        self.shares = None
        self.pairs = []

    def _keep_on_host(self, exc: BaseException) -> None:
        """The state did not fit on the device beside the model (that is why the plan offloaded it): hand
        it to the user's optimizer where it is, on the host, and say so, rather than fail in `close()` (a model
        whose AdamW moments alone are most of the GPU's budget meets this).
        """
        self.user.state.clear()  # what load_state_dict placed before the OOM
        _empty_device_cache()
        nbytes = 0
        for _, p, opt, key in self.pairs:
            if key in opt.state:
                self.user.state[p] = dict(opt.state[key])
                nbytes += sum(v.numel() * v.element_size() for v in opt.state[key].values()
                              if isinstance(v, torch.Tensor))
        log.warning("step.close(): the optimizer state (%s) did not fit on the device beside the model (%s), so "
                    "it stays on the host in your optimizer; stepping that optimizer outside the plan needs it on "
                    "the device (free memory first, then optimizer.load_state_dict(optimizer.state_dict())).",
                    format_bytes(nbytes), str(exc).splitlines()[0][:120])

    def _saved_state(self) -> dict[int, Any]:
        if self.shares is not None:
            self.shares.gather()  # partitioned over ranks: the other ranks' state (a collective)
        return {i: _like_param(opt.state[key], p) for i, p, opt, key in self.pairs if opt.state.get(key)}

    def _take_state(self, state: dict[int, Any]) -> None:
        # The user loaded a checkpoint into their optimizer: move its state, unrounded, into the host optimizer.
        owned = {k: state[index] for k, (index, _, _, _) in enumerate(self.pairs) if index in state}
        if self.shares is not None:
            self.shares.load_user_state({"state": owned})
        self.mirror()
        self.sync_hyperparameters()


def _like_param(state: dict[str, Any], p: nn.Parameter) -> dict[str, Any]:
    """A parameter's state as the user's optimizer holds it: for an FSDP2 shard, each plain local tensor of
    the shard's shape (the host keeps those) wrapped as a DTensor laid out like the parameter."""
    if not is_shard(p):
        return state
    from torch.distributed.tensor import DTensor  # (imported only where shards exist: devices/shards.py)

    local = p.to_local().shape
    return {k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            if isinstance(v, torch.Tensor) and not is_shard(v) and v.shape == local else v
            for k, v in state.items()}
