"""The CPU engine's copies between device and host: device gradients into the FP32 host gradient buffers, and
updated masters back into the device weights (through pinned staging buffers and a side stream on CUDA)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ...devices.ceiling import host_memory
from .local import local_part


class HostCopies:
    """Gradients to the host and weights back for a `HostOptimizer`, which inherits it (its fields are set
    there)."""

    params: list[nn.Parameter]
    master: dict[int, torch.Tensor]
    _grads: dict[int, torch.Tensor]
    _staging: dict[int, torch.Tensor]
    _stream: Any

    def _stage(self, i: int, grad: torch.Tensor) -> None:
        # on the side stream, in the hook (see the pipeline)
        self._staging[i].copy_(local_part(grad), non_blocking=True)

    def _host_grad(self, i: int) -> torch.Tensor:
        """The FP32 gradient buffer of host master `i`: the CPU step's engine gives each one (`give_gradients`)."""
        return self._grads[i]

    def _land(self, i: int) -> None:
        if self._staging:
            source = self._staging[i]
        else:
            grad = self.params[i].grad
            assert grad is not None, f"parameter {i} landed before backward made its gradient"
            source = local_part(grad)
        self._host_grad(i).copy_(source)
        self.master[i].grad = self._host_grad(i)  # (a worker-thread write: the main thread reads it after `drain`)

    def _copy_grads(self, indices: Sequence[int]) -> None:
        """The device gradients at `indices` into their FP32 host masters' (host-side copies: on the
        simulated device, not device memory); a master whose parameter got none has no gradient this step."""
        with host_memory():
            for i in indices:
                grad = self.params[i].grad
                if grad is None:
                    self.master[i].grad = None
                else:
                    self._host_grad(i).copy_(local_part(grad), non_blocking=True)
                    self.master[i].grad = self._host_grad(i)

    def _live_host_grads(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """The FP32 host gradients of those `indices` that got a gradient this step (`_copy_grads`)."""
        return [g for g in (self.master[i].grad for i in indices) if g is not None]

    def _write_back(self, indices: Sequence[int]) -> None:
        """Updated masters into the device weights (narrowed to their dtype)."""
        if self._staging:
            for i in indices:
                self._staging[i].copy_(self.master[i])  # narrowed on the CPU: 2 bytes a parameter cross PCIe
            self._send_back(indices)
            return
        for i in indices:
            local_part(self.params[i].data).copy_(self.master[i], non_blocking=True)

    def _send_back(self, indices: Sequence[int]) -> None:
        """Staged weights host to device on the side stream (the simulated device has no staging)."""
        if not self._staging:
            self._write_back(indices)
            return
        with torch.cuda.stream(self._stream):
            for i in indices:
                local_part(self.params[i].data).copy_(self._staging[i], non_blocking=True)
