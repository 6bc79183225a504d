"""Where trials run: the user's model moved to the device, or a sharded copy of it while the model waits on the
host, and afterwards the model back where it was with the weights, optimizer state and RNG it came with."""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import parallel as distributed
from ..devices.placement import Placement
from ..errors import DeviceError
from ..techniques.offload import host_buffers
from ..techniques.sharding import is_sharded, sharded_copy
from . import kept_rung
from .snapshot import Snapshot
from .tune_time import Laps

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Ground:
    """The model trials run on, and how to put its weights and buffers back as fit found them between trials
    (None on a sharded copy, which the snapshot of the user's model does not cover)."""

    model: nn.Module
    reset: Callable[[], None] | None


@contextlib.contextmanager
def trials_on(model: nn.Module, optimizer: Any, placement: Placement, *, copied: bool,
              precision: str, snapshot_to_disk: bool = False, nodes: int = 1,
              laps: Laps | None = None) -> Iterator[Ground]:
    """The model trials run on: `model` moved to the device or, `copied`, an FSDP2-sharded copy of it (sharding
    is in place and for good, and fit leaves the model as it found it) while `model` waits on the host, where
    the trials' peaks do not count it. On the way out, `model` is put back; a sharded copy's device shards
    are freed, and so are the host buffers the trials passed on to each other (`host_buffers`). A copy on
    `nodes` > 1 is hybrid-sharded: within each node, replicated across them. `laps` times the snapshot with the
    move ("snapshot") and putting the model back ("put back")."""
    laps = laps if laps is not None else Laps()
    home = device_of(model)
    away = torch.device("cpu") if copied else placement.torch_device
    with laps.phase("snapshot"):
        snapshot = Snapshot.take(model, optimizer, to_disk=snapshot_to_disk)
    poisoned = False
    try:
        with laps.phase("snapshot"):
            if home != away:
                model.to(away)
            tuned = sharded_copy(model, precision, nodes) if copied else model
            if is_sharded(tuned):
                distributed.guard_collectives(tuned)  # a trial's OOM on one rank stops every rank at one collective
        # optimizer offload's host buffers, and its rung between trials of one configuration, until the end
        with host_buffers.reusing(), kept_rung.keeping():
            yield Ground(model=tuned, reset=None if copied else snapshot.restore_values)
        del tuned
    except DeviceError as error:
        poisoned = True
        _put_back_noting(error, model, home, snapshot)
        raise
    finally:
        if not poisoned:
            with laps.phase("put back"):
                _put_back(model, home, snapshot)
    if copied:  # the sharded copy holds reference cycles (FSDP's hooks): free its device shards now
        gc.collect()
        if placement.kind == "cuda":
            torch.cuda.empty_cache()


def _put_back(model: nn.Module, home: torch.device, snapshot: Snapshot) -> None:
    """The model back on its own device, with the weights, optimizer state and RNG it came with."""
    if device_of(model) != home:
        model.to(home)
    snapshot.restore()


def _put_back_noting(error: DeviceError, model: nn.Module, home: torch.device, snapshot: Snapshot) -> None:
    """`_put_back` after a poisoned CUDA context: it calls CUDA, which fails again, and that failure must not
    replace the `DeviceError` that says why. It is logged and noted on the error instead."""
    try:
        _put_back(model, home, snapshot)
    except Exception as exc:  # noqa: BLE001 - the DeviceError is what the user must see
        text = f"restoring the model afterwards failed too ({type(exc).__name__}: {exc}); restart the process"
        log.warning("autotune: %s", text)
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(text)


def device_of(model: nn.Module) -> torch.device:
    """Where `model`'s parameters are (the CPU for a model without any)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
