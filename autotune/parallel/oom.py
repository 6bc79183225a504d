"""An OOM on one rank while the others go on: every rank leaves an attempt at the same collective.

Replicated, no collective runs inside an attempt before the ranks agree (see `TrainingStep._attempt`). A
sharded model is different: FSDP2 all-gathers each block before its forward and backward and
reduce-scatters its gradients after, so a rank that runs out of memory between two of those leaves the step
while the others go on into the next collective and wait there for it for good (seen on the CPU: one rank
in `agree_oom`, three in a backward prefetch all-gather). While an OOM is possible (`armed`: the trials, a
plan's first steps, after a recovery) each of FSDP's collectives is preceded by a check-in
(`guard_collectives`): one all-reduce (MAX) of [ran out of memory, still in the step]. A rank that ran out of
memory comes to no further check-in: it goes to the end of the attempt (`agree_oom`), which answers the
others' check-ins with [1, 0] until no rank is still in the step; a rank whose check-in hears of an OOM
raises one of its own there and goes to the end too. So every rank leaves at the same collective and all
re-run the batch. The idea is Composer's FSDP sync hook; placed inside FSDP's own collectives, no other
collective runs between a check-in and the one it guards. Armed, it costs a small all-reduce and a host
sync per FSDP collective, so steady training (plan proven for a few steps) runs without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .. import torch_private
from ..devices.ceiling import host_memory
from ..devices.shards import fsdp_units
from .fsdp_comms import wrap_comms
from .ranks import active, collective_device

_armed = 0
ANOTHER_RANK_OOM = "CUDA out of memory on another rank (autotune stopped this rank at the same collective)"


@contextlib.contextmanager
def armed(on: bool = True) -> Iterator[None]:
    """Check in before each guarded FSDP collective inside this block (every rank must arm alike)."""
    global _armed
    if not on:
        yield
        return
    _armed += 1
    try:
        yield
    finally:
        _armed -= 1


def check_in() -> None:
    """Before an FSDP collective: raise an OOM here when another rank has run out of memory."""
    if not _armed or not active():
        return
    oom, _ = _exchange(oom=False, in_step=True)
    if oom:
        raise torch.OutOfMemoryError(ANOTHER_RANK_OOM)


def agree_oom(oom: bool) -> bool:
    """At the end of an attempt: True on every rank when any rank ran out of memory.

    Answers the check-ins of ranks still in the step until none is, so it also ends theirs (see above).
    """
    if not active():
        return oom
    while True:
        any_oom, in_step = _exchange(oom=oom, in_step=False)
        if not in_step:
            return any_oom


@contextlib.contextmanager
def leaving_together(model: torch.nn.Module) -> Iterator[None]:
    """Around forwards of a sharded `model` outside a step (the loss check on the example batch): an error on
    one rank (an OOM in `loss_fn` before the model runs, say) while the others go on into FSDP's next
    all-gather leaves every rank at the same collective, and the block raises on every rank: where it failed
    and, elsewhere, an OOM saying it came from another rank. A model that is not sharded runs no collective
    in its forward, and is left alone."""
    if not active() or not guard_collectives(model):
        yield
        return
    try:
        with armed():
            yield
    except Exception:
        agree_oom(True)  # answers the check-ins of ranks still in their forwards: they raise there
        raise
    if agree_oom(False):
        raise torch.OutOfMemoryError(ANOTHER_RANK_OOM)


def _exchange(*, oom: bool, in_step: bool) -> tuple[bool, bool]:
    # Uncounted by the simulated ceiling: its OOM raised here, after the all-reduce and before the collective
    # this check-in guards, would leave this rank out of a collective the others just agreed to run.
    with host_memory():
        flags = torch.tensor([int(oom), int(in_step)], dtype=torch.int32, device=collective_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        any_oom, any_in_step = flags.tolist()
    return bool(any_oom), bool(any_in_step)


def guard_collectives(model: torch.nn.Module) -> bool:
    """Put a check-in before every FSDP2 collective of `model` (idempotent); False where torch cannot."""
    units = fsdp_units(model)
    if not units or not hasattr(units[0], "set_custom_all_gather"):
        return False
    for unit in units:
        wrap_comms(unit, before=check_in)
    return True


param_groups = torch_private.fsdp_param_groups  # an FSDP2 state's parameter groups
