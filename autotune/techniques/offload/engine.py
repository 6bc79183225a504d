"""The common base of optimizer offload's two engines: the interface the training step calls (interface.py),
over the shares both engines step (shares.py). Each engine steps the host share its own way and owns the
buffers that takes: the CPU optimizer over host gradients (`host_engine.py`), or the GPU with the host state
streamed through it (`streamed_engine.py`); `interface.build_engine` decides which. The base runs what they
have in common: the loss scale and clipping factor, the device share's step, the weights shared over ranks,
the state dict and `restore()`.
"""

from __future__ import annotations

import abc
import math
from typing import Any

import torch

from .shares import Shares


class HostOptimizer(abc.ABC):
    """Optimizer offload: FP32 masters and state on the host, 16-bit weights and gradients on the device.

    `step()` steps the device share on the device and the host share by the engine (the subclass), and copies
    the updated masters back into the device weights (cast to 16 bits). `restore()` puts FP32 weights back on
    the device and drops the host copies. `arm()` before the last backward lets an engine start the step's
    work during it; the parameters are the same either way.
    """

    engaged = True  # an engine steps the optimizer (interface.py)

    def __init__(self, shares: Shares, scaler: torch.amp.GradScaler | None) -> None:
        self.shares = shares
        self.scaler = scaler
        holder = shares.optimizer or shares.device_optimizer
        self.param_groups = holder.param_groups
        # Gradient clipping (training/clipping.py) sets this before `step`: the host gradients are multiplied
        # by it after unscaling, in FP32, and it goes back to 1 after the step.
        self.grad_factor = 1.0
        self.skip: set[int] = set()  # positions already stepped for this batch by an aborted attempt
        self.gather_on_restore = False  # set by TrainingStep: restore() gathers the other ranks' weights and state

    # -- what each engine does its own way ----------------------------------------------------------------
    @abc.abstractmethod
    def arm(self, defer: bool = False) -> None:
        """The next backward is the last before `step()`: start the host share's work during it.

        `defer=True` when a gradient may still change after backward (clipping, loss scaling, a callback):
        nothing may be stepped before `step()`."""

    @abc.abstractmethod
    def abort(self) -> set[int]:
        """The armed attempt ran out of memory and will be re-run: the positions stepped for good (their
        weights, still old on the device, go back with the re-run's step; they are not stepped again)."""

    @abc.abstractmethod
    def _prepare(self) -> set[int]:
        """Before the step: the host share's gradients where the engine steps from, and the positions stepped
        already (during backward, or by an aborted attempt)."""

    @abc.abstractmethod
    def _host_grads(self, indices: list[int]) -> list[torch.Tensor]:
        """The host share's FP32 gradients at `indices` that unscaling and clipping act on (the engine's own)."""

    @abc.abstractmethod
    def _step_host_share(self, stepped: set[int], rest: list[int], factor: float) -> None:
        """Step the host share but `stepped` (`rest`, with gradients times `factor`) and write its weights back."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Stop every copy and step still running and let go of the engine's buffers (before `restore`)."""

    @abc.abstractmethod
    def _failed(self) -> None:
        """The step raised: undo what is half done."""

    @abc.abstractmethod
    def _reset(self) -> None:
        """The step is over, done or failed: forget its bookkeeping."""

    # -- the interface --------------------------------------------------------------------------------------
    def keep_stepped(self, positions: set[int]) -> set[int]:
        """After a rung switch: these positions keep the update an aborted attempt gave them (not stepped
        twice; the re-run sees their new weights). The ones this engine steps."""
        self.skip = positions & set(self.shares.host_index)
        return self.skip

    def scale_gradients(self, factor: float) -> None:
        """Clipping's factor: the FP32 host gradients are multiplied by it after unscaling, for the next step."""
        self.grad_factor = factor

    def for_training(self) -> None:
        """`restore()` hands every rank's weights and state back (partitioned over ranks)."""
        self.gather_on_restore = True

    def state_dict(self) -> dict[str, Any]:
        """The state of both shares, keyed as the user's optimizer keys it (partitioned: gathered from every
        rank, so every rank must call it)."""
        return self.shares.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The inverse of `state_dict()`: a state dict of the user's layout."""
        self.shares.load_user_state(state_dict)

    def discard_state(self) -> None:
        """Drop the optimizer state of both shares (a trial's), before `restore` (see `Shares.discard_state`)."""
        self.shares.discard_state()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.shares.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def restore(self) -> None:
        """Undo the offload: the weights back on the device in the dtype they came in, host copies released."""
        self._close()  # nothing may still read the device gradients or write the engine's buffers
        self.shares.restore(gather=self.gather_on_restore)

    # -- the step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        self.shares.forget_weights()  # gathered for a state dict before this step: stale after it
        stepped = self._prepare()
        try:
            self._update(stepped)
            if self.shares.partition is not None:
                self.shares.partition.share_weights(self.shares.params)  # every rank's updated weights to the others
        except BaseException:
            self._failed()
            raise
        finally:
            self.skip = set()
            self._reset()

    def _update(self, stepped: set[int]) -> None:
        """Unscale and clip what was not stepped yet, step it, and bring every host weight back."""
        shares = self.shares
        factor, self.grad_factor = self.grad_factor, 1.0
        device_grads = shares.device_grads()
        try:
            if self.scaler is not None and not self._unscale(device_grads):
                return  # non-finite gradients: skip this step, as GradScaler.step would
            rest = [i for i in shares.host_index if i not in stepped]
            if factor != 1.0:
                for g in self._host_grads(rest) + device_grads:
                    g.mul_(factor)
            shares.step_device()  # queued on the device, while the host steps its share
        finally:
            shares.drop_device_grads()
        if shares.host_index:  # empty: every master on the device (partitioned over the ranks)
            self._step_host_share(stepped, rest, factor)

    def _unscale(self, device: list[torch.Tensor]) -> bool:
        """FP16 only: divide the gradients by the loss scale; False (and a smaller scale) on inf/NaN."""
        scaler = self.scaler
        assert scaler is not None, "unscaling without a loss scaler"
        scale = float(scaler.get_scale())
        host = self._host_grads(self.shares.host_index)
        finite = all(math.isfinite(float(g.abs().max())) for g in host + device if g.numel())
        if finite:
            for g in host + device:
                g.div_(scale)
            scaler.update(scale)
        else:
            scaler.update(scale * scaler.get_backoff_factor())
        return finite
