"""The one interface the training step uses for optimizer offload, whichever engine steps the optimizer.

`offload_of(optimizer)` is the optimizer itself under optimizer offload (a `HostOptimizer`: the CPU
engine, with the host share streamed through the GPU where it can) and `NO_OFFLOAD` otherwise, so the
caller never asks which it holds:

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

from typing import Any, Protocol

from .cpu_engine import HostOptimizer


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
