"""The optimizer-offload rung a trial leaves on the model for the next trial of the same configuration.

Optimizer offload's engine is the costliest part of a trial's set-up and clean-up: building it copies every
weight into FP32 host masters and shrinks the device weights to 16 bits, and undoing it copies the masters
back. Between two trials that differ only in micro-batch none of that changes. So while `keeping()` is in
force (`search.ground.trials_on`, around a tune's trials), a trial of optimizer offload that ran its steps
leaves its rung on the model (`keep`), its optimizer state dropped as a fresh engine would start without
it, and the next trial of the same rung, host share and overlap runs on it (`take`): no masters copied, no
weights restored. Any other trial undoes it first, and so do the start and end of a search and the end of
`keeping()` (`release`): nothing but a trial of that configuration ever sees the model under it.

A trial on a kept rung measures what a fresh one would: the device tensors the engine holds count in its
peak (`resident`), the host bytes it holds in its host peak (as the pool's buffers lent again would), and
the host optimizer's worker thread starts again under the trial's own simulated ceiling.

Kept only in a single process (ranks would each decide), without a GradScaler (its scale is state a trial
starts without), with the tune's host-buffer pool in force (what the engine holds is counted from it) and,
on the simulated device, with the host share stepped on the host (a streamed engine's device buffers are
not counted there).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .. import parallel as distributed
from ..configuration import Rung
from ..devices.placement import Placement, release_memory
from ..techniques import AppliedRung
from ..techniques.offload import HostOptimizer, HostSteppedEngine, StreamedEngine, host_buffers

Key = tuple[Rung, float, bool, str]  # the rung, its host share, whether the measured steps overlap, its sharding


@dataclass(kw_only=True, slots=True)
class KeptCounts:
    """Rungs kept, taken by the next trial and undone since the process started (what a test reads)."""

    kept: int = 0
    taken: int = 0
    released: int = 0


COUNTS = KeptCounts()


@dataclass(kw_only=True, slots=True)
class Kept:
    """A rung left on the model, and the host bytes its engine holds from the pool."""

    key: Key
    applied: AppliedRung
    placement: Placement
    host_bytes: int


_kept: list[Kept] = []  # the rung kept now, at most one
_keeping: list[bool] = []  # [True] while `keeping()` is in force


@contextlib.contextmanager
def keeping() -> Iterator[None]:
    """While inside, a trial of optimizer offload may leave its rung for the next; on the way out it is undone."""
    _keeping[:] = [True]
    try:
        yield
    except BaseException:
        _keeping.clear()
        # the error on its way out says why (a poisoned CUDA context would fail the release again): kept
        with contextlib.suppress(Exception):
            release()
        _kept.clear()
        raise
    _keeping.clear()
    release()


def keeps(applied: AppliedRung, placement: Placement) -> bool:
    """Whether `applied`, whose trial ran its steps, may stay on the model for the next trial."""
    engine = applied.optimizer
    return (bool(_keeping) and isinstance(engine, HostOptimizer) and applied.scaler is None
            and engine.shares.partition is None and not distributed.active() and host_buffers.pooling()
            and not (placement.simulated and isinstance(engine, StreamedEngine)))


def keep(key: Key, applied: AppliedRung, placement: Placement) -> int:
    """Leave `applied` on the model for the next trial of `key`, its optimizer state dropped; the host bytes
    its trial was lent again from the pool (`host_buffers.hold`)."""
    engine = applied.optimizer
    assert isinstance(engine, HostOptimizer), "only optimizer offload's rung is kept"
    engine.discard_state()  # the next trial starts from no state, as a freshly built engine does
    staging = 0  # pinned, outside the pool
    if isinstance(engine, HostSteppedEngine):
        if engine.pipeline is not None:
            engine.pipeline.stop_worker()
        staging = sum(t.numel() * t.element_size() for t in engine.copies.staging.values())
    reused, held = host_buffers.hold()
    _kept[:] = [Kept(key=key, applied=applied, placement=placement, host_bytes=held + staging)]
    COUNTS.kept += 1
    return reused


def holds_other(key: Key) -> bool:
    """Whether a rung is kept for a configuration other than `key` (the next trial undoes it first)."""
    return bool(_kept) and _kept[0].key != key


def take(key: Key) -> tuple[AppliedRung | None, int]:
    """The rung kept for `key` and the host bytes it holds, now the caller's; (None, 0) where none is (a rung
    kept for another configuration is undone first)."""
    if _kept and _kept[0].key == key:
        kept = _kept.pop()
        kept.applied.host_buffer_seconds = 0.0  # built by an earlier trial
        COUNTS.taken += 1
        return kept.applied, kept.host_bytes
    release()
    return None, 0


def resident(applied: AppliedRung) -> list[torch.Tensor]:
    """The device tensors a kept engine holds beside the model's parameters: the device share's FP32 masters."""
    engine = applied.optimizer
    if not isinstance(engine, HostOptimizer):
        return []
    shares = engine.shares
    return [m for i, m in shares.device_master.items() if m is not shares.params[i]]


def release() -> None:
    """Undo the rung kept, if any: the FP32 weights back on the device, its host buffers back in the pool."""
    if not _kept:
        return
    kept = _kept.pop()
    applied, placement = kept.applied, kept.placement
    applied.remove()
    applied.optimizer = None
    host_buffers.reclaim()
    for p in applied.model.parameters():
        p.grad = None
    del applied, kept  # the engine's last references: gone before the memory is given back
    gc.collect()
    release_memory(placement)
    COUNTS.released += 1
