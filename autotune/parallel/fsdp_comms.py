"""FSDP2's all-gather and reduce-scatter with a call of autotune's before or after each (`FSDPModule.set_custom_*`).

Two things ride on FSDP's own collectives: the check-in that lets every rank leave an OOM'd attempt at the same
collective (`oom.guard_collectives`), and the test-only pause of a collective that crosses nodes
(`topology.slow_link`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import torch_private


class WrappedComm:
    """FSDP's all-gather or reduce-scatter, with `before()` called before it and `after()` after it.

    torch's AllGather / ReduceScatter are private ABCs: this wraps either by duck typing.
    """

    def __init__(self, inner: Any, *, before: Callable[[], None] | None = None,
                 after: Callable[[], None] | None = None) -> None:
        self.inner = inner
        self.before = before
        self.after = after

    def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.before is not None:
            self.before()
        out = self.inner(*args, **kwargs)
        if self.after is not None:
            self.after()
        return out


def wrap_comms(unit: Any, *, before: Callable[[], None] | None = None,
               after: Callable[[], None] | None = None) -> None:
    """Wrap the all-gather and reduce-scatter of FSDP2 module `unit` in `before` / `after`, once: a collective
    already wrapped in the same calls is left as it is."""
    groups = torch_private.fsdp_param_groups(torch_private.fsdp_state(unit))
    if len(groups) != 1:
        return  # a unit without parameters runs no collective; several groups cannot take a custom comm
    group = groups[0]
    if not _wrapped(group._all_gather_comm, before, after):
        unit.set_custom_all_gather(WrappedComm(group._all_gather_comm, before=before, after=after))
    if not _wrapped(group._reduce_scatter_comm, before, after):
        unit.set_custom_reduce_scatter(WrappedComm(group._reduce_scatter_comm, before=before, after=after))


def _wrapped(comm: Any, before: Callable[[], None] | None, after: Callable[[], None] | None) -> bool:
    return isinstance(comm, WrappedComm) and comm.before is before and comm.after is after
