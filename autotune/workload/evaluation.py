"""Forwards that leave no trace: the user's model run in eval mode without gradients, and everything such a
forward may change put back after it (train/eval flags, buffers, random streams, and parameters the forward
writes in place, such as a max-norm constraint renormalizing its weight); an FSDP2 model is left sharded.

Parameters are put back copy-on-write: a dispatch mode sees every operator that writes a tensor in place and
copies a parameter only before its first write, so a model whose forward writes none (nearly all) costs no
copy of its weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .. import torch_private
from ..devices.shards import fsdp_units
from ..torch_private import DispatchMode


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode without gradients; the train/eval flags, the buffers, the parameters and the random streams
    put back after."""
    modes = [(m, m.training) for m in model.modules()]
    buffers = [(module, name, buffer, buffer.detach().clone()) for module in model.modules()
               for name, buffer in module._buffers.items() if buffer is not None]
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    guard = _FirstValues(list(model.parameters()))
    with torch.random.fork_rng(devices=cuda), torch.no_grad():
        model.eval()
        try:
            with guard:
                yield
        finally:
            _reshard(model)
            for module, training in modes:
                module.training = training
            for module, name, buffer, saved in buffers:
                module._buffers[name] = buffer
                buffer.copy_(saved)
            guard.put_back()


def _reshard(model: nn.Module) -> None:
    """An FSDP2 model's parameters sharded again: its root keeps them gathered after a forward, for the backward
    that a forward without gradients never runs, and whatever comes next (a snapshot, a step) expects shards."""
    for unit in fsdp_units(model):
        unit.reshard()


def _storage(tensor: Any) -> int | None:
    """The address of the storage under `tensor` (a DTensor's local shard); None where it has none."""
    tensor = torch_private.local_tensor(tensor)
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


class _FirstValues(DispatchMode):
    """Keeps a copy of each watched parameter from before its first in-place write, to put back after."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.watched = {key: p for p in params if (key := _storage(p)) is not None}
        self.saved: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.watched and func._schema.is_mutable:
            for value in _written(func._schema, args, kwargs):
                key = _storage(value)
                if key in self.watched and key not in self.saved:
                    param = self.watched[key]
                    self.saved[key] = (param, param.detach().clone())
        return func(*args, **kwargs)

    def put_back(self) -> None:
        with torch.no_grad():
            for param, value in self.saved.values():
                param.copy_(value)
        self.saved.clear()


def _written(schema: Any, args: tuple, kwargs: dict) -> Iterator[Any]:
    """The tensors an operator call writes in place, by its schema's write annotations."""
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        yield from value if isinstance(value, (list, tuple)) else (value,)
