"""The one interface the training step uses for optimizer offload, whichever engine steps the optimizer, and
the one place that decides which engine that is (`build_engine`).

`offload_of(optimizer)` is the optimizer itself under optimizer offload (a `HostOptimizer`: the
host-stepped engine, `host_engine.py`, or the streamed one, `streamed_engine.py`) and `NO_OFFLOAD` otherwise,
so the caller never asks which it holds:

    arm(defer)          the next backward is the last before the step: start the host's work during it
    abort()             that attempt failed: the positions already stepped for good (kept, not re-stepped)
    step()              the optimizer step (the device gradients are final)
    state_dict() / load_state_dict(sd)   the state of every share, in the user's optimizer's layout
    restore()           undo the offload: weights back on the device, host copies released
    scale_gradients(f)  clipping's factor, applied by the engine to its own FP32 gradients
    keep_stepped(pos)   after a rung switch: these positions keep the update an aborted attempt gave them
    for_training()      restore() hands every rank's state back (training; the trials do not need it)
    discard_state()     a trial's state, dropped before restore() (room for the FP32 weights)
    engaged             whether an engine steps the optimizer (it then unscales and clips itself)
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ...workload.optimizers import OptimizerSpec
from .engine import HostOptimizer
from .host_engine import HostSteppedEngine
from .local import local_part
from .shares import Shares
from .streamed import stream_wanted, streamable
from .streamed_engine import StreamedEngine


class OptimizerOffload(Protocol):
    engaged: bool

    def arm(self, defer: bool = False) -> None: ...

    def abort(self) -> set[int]: ...

    def step(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def restore(self) -> None: ...

    def scale_gradients(self, factor: float) -> None: ...

    def keep_stepped(self, positions: set[int]) -> set[int]: ...

    def for_training(self) -> None: ...

    def discard_state(self) -> None: ...


class NoOffload:
    """The optimizer steps on the device: nothing to arm, abort, scale or restore."""

    engaged = False

    def arm(self, defer: bool = False) -> None:
        pass

    def abort(self) -> set[int]:
        return set()

    def step(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def restore(self) -> None:
        pass

    def scale_gradients(self, factor: float) -> None:
        pass

    def keep_stepped(self, positions: set[int]) -> set[int]:
        return set()

    def for_training(self) -> None:
        pass

    def discard_state(self) -> None:
        pass


NO_OFFLOAD = NoOffload()


def offload_of(optimizer: Any) -> OptimizerOffload:
    """The engine stepping `optimizer` under optimizer offload, else `NO_OFFLOAD`."""
    return optimizer if isinstance(optimizer, HostOptimizer) else NO_OFFLOAD


def build_engine(params: Sequence[nn.Parameter], spec: OptimizerSpec, dtype: torch.dtype,
                 scaler: torch.amp.GradScaler | None = None, state: dict[str, Any] | None = None,
                 keep_fp32: Collection[nn.Parameter] = (), *, fraction: float = 1.0,
                 overlap: bool | None = None) -> HostOptimizer:
    """Optimizer offload of `params` (16-bit device weights in `dtype`, `fraction` of the masters on the host,
    `state` of the user's layout loaded): the streamed engine where it can step the host share, else the
    host-stepped one. `overlap` is the plan's (`plan.offload_overlap`; None: the engine's default)."""
    shares = Shares(params, spec, dtype, state, keep_fp32, fraction=fraction)
    if _can_stream(shares, scaler):
        return StreamedEngine(shares, overlap=overlap)
    return HostSteppedEngine(shares, scaler, overlap=overlap)


def _can_stream(shares: Shares, scaler: torch.amp.GradScaler | None) -> bool:
    """Whether the GPU steps the host share, its state streamed (streamed.py): on CUDA unless
    $AUTOTUNE_OFFLOAD_STREAM=0 (=1 also on the CPU test device), for Adam/AdamW over contiguous masters of one
    dtype (of FSDP2 shards, this rank's parts), without a GradScaler (its unscale and inf check run on the host
    gradients)."""
    device = shares.params[0].device if shares.params else torch.device("cpu")
    if (not stream_wanted(device.type) or shares.flat is None or scaler is not None
            or streamable(shares.optimizer)):
        return False
    return all(local_part(shares.params[i]).is_contiguous() for i in shares.host_index)
