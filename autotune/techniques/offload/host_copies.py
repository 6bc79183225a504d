"""The host-stepped engine's copies between device and host: device gradients into the FP32 host gradient
buffers, and updated masters back into the device weights (on CUDA, through pinned staging buffers in the
device weights' dtype and a side stream, while the pipeline overlaps backward)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...devices.ceiling import host_memory
from .local import local_part
from .shares import Shares


class HostCopies:
    """The FP32 host gradient of each host master (its `.grad` in a step where its parameter got a gradient,
    None in one where it did not, so the CPU optimizer skips it as torch would) and, overlapped on CUDA, the
    pinned staging buffers and side stream the copies run through."""

    def __init__(self, shares: Shares) -> None:
        self.shares = shares
        self.grads = {i: m.grad for i, m in shares.master.items() if m.grad is not None}
        self.staging: dict[int, torch.Tensor] = {}  # CUDA only: pinned buffers in the device weights' dtype
        self.stream: Any = None

    def stage_through(self, stream: Any) -> None:
        """CUDA: one pinned buffer per host parameter in the device weight's dtype (gradient out, weight back),
        copied on `stream`."""
        shares = self.shares
        self.staging = {i: torch.empty(shares.master[i].shape, dtype=shares.params[i].dtype, pin_memory=True)
                        for i in shares.host_index}
        self.stream = stream

    def stage(self, i: int, grad: torch.Tensor) -> None:
        # on the side stream, in the hook (see the pipeline)
        self.staging[i].copy_(local_part(grad), non_blocking=True)

    def land(self, i: int) -> None:
        """Position i's gradient, staged or on the device, into its FP32 host gradient."""
        if self.staging:
            source = self.staging[i]
        else:
            grad = self.shares.params[i].grad
            assert grad is not None, f"parameter {i} landed before backward made its gradient"
            source = local_part(grad)
        self.grads[i].copy_(source)
        self.shares.master[i].grad = self.grads[i]  # (a worker-thread write: the main thread reads it after `drain`)

    def copy_grads(self, indices: Sequence[int]) -> None:
        """The device gradients at `indices` into their FP32 host masters' (host-side copies: on the
        simulated device, not device memory); a master whose parameter got none has no gradient this step."""
        master = self.shares.master
        with host_memory():
            for i in indices:
                grad = self.shares.params[i].grad
                if grad is None:
                    master[i].grad = None
                else:
                    self.grads[i].copy_(local_part(grad), non_blocking=True)
                    master[i].grad = self.grads[i]

    def live(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """The FP32 host gradients of those `indices` that got a gradient this step (`copy_grads`)."""
        return [g for g in (self.shares.master[i].grad for i in indices) if g is not None]

    def narrow(self, indices: Sequence[int]) -> None:
        """Updated masters into their staging buffers, narrowed on the CPU: 2 bytes a parameter cross PCIe."""
        for i in indices:
            self.staging[i].copy_(self.shares.master[i])

    def write_back(self, indices: Sequence[int]) -> None:
        """Updated masters into the device weights (narrowed to their dtype)."""
        if self.staging:
            self.narrow(indices)
            self.send_back(indices)
            return
        for i in indices:
            local_part(self.shares.params[i].data).copy_(self.shares.master[i], non_blocking=True)

    def send_back(self, indices: Sequence[int]) -> None:
        """Staged weights host to device on the side stream (the simulated device has no staging)."""
        if not self.staging:
            self.write_back(indices)
            return
        with torch.cuda.stream(self.stream):
            for i in indices:
                local_part(self.shares.params[i].data).copy_(self.staging[i], non_blocking=True)

    def settle(self) -> None:
        """The current stream (the next forward) waits for the weights sent back on the side stream."""
        if self.stream is not None:
            torch.cuda.current_stream(self.shares.params[0].device).wait_stream(self.stream)

    def release(self) -> None:
        """Let go of the host gradients and staging buffers (the offload is undone)."""
        self.grads = {}
        self.staging = {}
