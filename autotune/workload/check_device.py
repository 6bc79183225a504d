"""Where `fit` checks the loss: on the GPU it tunes on, also when the model waits on the CPU.

`fit` checks what it puts in place of the user's loss (`loss_checks.py`) on the model where the user left it,
before the trials move it. A model loaded on the CPU (`from_pretrained` loads there) would run the check's few
forwards on the CPU: 24 s for GPT-2 small at 4 x 1024 tokens on two cores, and more in proportion to a larger
model's FLOPs, where a GPU takes a fraction of a second. So a model whose parameters and buffers all lie on the
CPU goes to the GPU for the check and comes back after, its parameter objects and values as they were
(`Module.to` moves each tensor's data in place), where it fits with room for the forwards. An out-of-memory
error on the GPU sends the check back to the CPU, where it runs as before; a model it cannot move (a sharded
one, one spread over devices by a device map, tensor subclasses, several ranks, each of which would decide
alone) stays where it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..devices.placement import Placement, release_memory
from ..errors import is_oom
from ..sizes import parse_bytes
from . import loss_checks

log = logging.getLogger("autotune")

ROOM = 2.0  # the free device memory a visit needs, in model sizes: the model, and its forwards beside it
SPARE = 2 << 30  # and a fixed spare for the forwards' logits and the loss over them


def checked(model: nn.Module, placement: Placement, budget: int | str | None, world: int,
            check: Callable[[], loss_checks.CheckedLoss]) -> loss_checks.CheckedLoss:
    """`check()` (a `loss_checks.check_and_record` on the model's own device) with the model on the tuning GPU
    where it waits on the CPU and fits there; on the CPU again if the GPU runs out of memory."""
    if not _visits(model, placement, budget, world):
        return check()
    try:
        with _on(model, placement), loss_checks.out_of_memory_raised():
            return check()
    except Exception as exc:
        if not is_oom(exc):
            raise
        log.info("autotune: the loss check ran out of memory on %s; checking on the CPU instead", placement.name)
    return check()


def _visits(model: nn.Module, placement: Placement, budget: int | str | None, world: int) -> bool:
    if placement.kind != "cuda" or world > 1 or getattr(model, "hf_device_map", None):
        return False
    if torch.__future__.get_overwrite_module_params_on_conversion():  # `to` would make new parameter objects
        return False
    tensors = [*model.parameters(), *model.buffers()]  # a sharded model's are DTensors: a subclass, not moved
    if not tensors or any(t.device.type != "cpu" or type(t.data) is not torch.Tensor for t in tensors):
        return False
    size = sum(t.numel() * t.element_size() for t in tensors)
    free, _ = torch.cuda.mem_get_info(placement.index)
    room = min(free, parse_bytes(budget)) if budget is not None else free
    return ROOM * size + SPARE <= room


@contextmanager
def _on(model: nn.Module, placement: Placement) -> Iterator[None]:
    """The model on the GPU inside, on the CPU again after (also when moving it there failed half-way)."""
    try:
        model.to(torch.device("cuda", placement.index))
        yield
    finally:
        model.to("cpu")
        release_memory(placement)
