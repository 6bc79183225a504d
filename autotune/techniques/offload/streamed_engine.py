"""The streamed engine of optimizer offload: the GPU steps the host share, each segment of masters and moments
streamed in, stepped by torch's fused Adam or AdamW and streamed back (`streamed.py`'s `DeviceStepper`),
serially after backward or issued from the last backward's post-accumulate-grad hooks as gradients become
final. It reads the device gradients, so the host share keeps no FP32 gradient copy and there is no pipeline;
its own buffers are the stepper's (the moments, the device ring, and an overlapped step's spare set).
`interface.build_engine` picks it where the optimizer and the masters allow it.
"""

from __future__ import annotations

from typing import Any

import torch

from .engine import HostOptimizer
from .shares import Shares
from .streamed import DeviceStepper
from .tensors import overlap_default


class StreamedEngine(HostOptimizer):
    """The host share stepped on the device by a `DeviceStepper`, its state streamed over PCIe.

    Overlapped, each segment is issued from the post-accumulate-grad hooks of the last backward: only where the
    plan asks for it (`overlap=True`; issued from a worker thread instead it was no faster), and never with
    $AUTOTUNE_OFFLOAD_OVERLAP=0. Serial only: over FSDP2 shards (FSDP assigns the reduced gradients on its own
    stream, outside the hooks), and partitioned over ranks (a rank that ran out of memory in its hooks would
    leave the others waiting for its weights: the check-in guards the step, not the backward).
    """

    def __init__(self, shares: Shares, *, overlap: bool | None = None) -> None:
        super().__init__(shares, None)  # no GradScaler: its unscale and inf check need host gradients
        assert shares.flat is not None, "the streamed engine steps views of one flat buffer"
        device = shares.params[0].device
        self.stepper: DeviceStepper | None = DeviceStepper(shares.optimizer, shares.flat, shares.master,
                                                           shares.host_index, shares.params, device)
        self.overlap = (overlap is True and overlap_default() and shares.partition is None
                        and not shares.sharded)
        if self.overlap:
            self.stepper.reserve()  # now, not in the first (timed) step: its second set of buffers is large
        self._hooks: list[Any] = []

    def arm(self, defer: bool = False) -> None:
        """Overlapped: segments are issued from the hooks of the next backward as their gradients land. Not
        where a gradient may still change (`defer`), nor where an aborted attempt stepped some positions
        already (`keep_stepped`): an overlapped step writes every segment of the share anew, the serial one
        only those it steps."""
        stepper = self.stepper
        if not self.overlap or defer or self.skip or stepper is None:
            return
        index = self.shares.host_index
        stepper.begin(index)
        self._hooks = [self.shares.params[i].register_post_accumulate_grad_hook(lambda p, i=i: stepper.landed(i))
                       for i in index]

    def _disarm(self, *, failed: bool) -> None:
        """Remove the hooks; after a failed backward, undo what was issued (see the stepper)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if failed and self.stepper is not None and self.stepper.armed:
            self.stepper.abort()

    def abort(self) -> set[int]:
        """Nothing was stepped for good: the weights go back and the re-run steps everything."""
        self._disarm(failed=True)
        return set(self.skip)

    # -- the step ----------------------------------------------------------------------------------------
    def _prepare(self) -> set[int]:
        return set(self.skip)  # the stepper reads the device gradients itself

    def _host_grads(self, indices: list[int]) -> list[torch.Tensor]:
        return []  # the stepper multiplies the device gradients by the clipping factor as it widens them

    def _step_host_share(self, stepped: set[int], rest: list[int], factor: float) -> None:
        """The device steps the host share (overlapped: issues what the last backward left), then is waited for."""
        stepper = self.stepper
        assert stepper is not None, "stepped after restore()"
        if stepper.armed:
            self._disarm(failed=False)
            stepper.issue_rest()
            stepper.finish()
        else:
            stepper.step(rest, factor=factor)
            stepper.wait()

    def _failed(self) -> None:
        self._disarm(failed=True)  # overlapped and not finished: the old weights back, the state untouched
        if self.stepper is not None:
            self.stepper.close()  # a step failed half-way: no copy may still run into buffers freed next

    def _reset(self) -> None:
        """No bookkeeping beyond the stepper's, which `finish` and `abort` end."""

    def _close(self) -> None:
        self._disarm(failed=True)  # an armed backward that never reached the step (a trial's OOM)
        if self.stepper is not None:
            self.stepper.close()  # nothing may still read the device gradients or write its buffers once freed
        self.stepper = None
