"""Large pinned host buffers at their exact size.

torch's pinned allocator (`pin_memory=True`) rounds every block up to a power of two so that freed blocks can
be reused: a 13.4 GiB buffer of FP32 masters takes 16 GiB of page-locked RAM, and the masters and two
moments of a 3B-parameter model waste 8 GiB between them, which the host budget cannot see in advance. A
buffer of `EXACT_FROM` bytes or more is instead an anonymous mapping of exactly its size, its pages touched by
torch's threads (faster than the driver pinning them one by one), then registered with CUDA
(`cudaHostRegister`): copies from it are asynchronous as from any pinned memory, and its host need is what
`techniques/host_need.py` computes. It is unregistered before its mapping goes, when its last tensor does.

Where registration is refused (no CUDA runtime, a locked-memory limit), the buffer comes from torch's
allocator as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap

import torch

log = logging.getLogger(__name__)

EXACT_FROM = 256 << 20  # smaller buffers lose little to rounding, and torch's allocator reuses them


class _Registered(mmap.mmap):
    """An anonymous mapping registered with CUDA; unregistered first when it is collected."""

    address = 0

    def __del__(self) -> None:
        if self.address:
            address, self.address = self.address, 0
            with contextlib.suppress(Exception):  # at interpreter exit torch may be gone: the OS frees it all
                torch.cuda.cudart().cudaHostUnregister(address)


def pinned_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 1-D host tensor of `numel` elements that CUDA copies from asynchronously, zero-filled when it is
    large (its pages are touched to register them), uninitialised otherwise."""
    size = numel * torch.empty((), dtype=dtype).element_size()
    if size < EXACT_FROM or not torch.cuda.is_available():
        return torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())
    buffer = _Registered(-1, size)
    tensor = torch.frombuffer(buffer, dtype=dtype, count=numel)
    tensor.zero_()  # the pages, touched on torch's threads before the driver locks them
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    error = torch.cuda.cudart().cudaHostRegister(address, size, 0)
    if int(error) != 0:
        log.info("cudaHostRegister of %d bytes failed (%s); using torch's pinned allocator", size, error)
        del tensor
        buffer.close()
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    buffer.address = address
    return tensor


def pinned_like(t: torch.Tensor) -> torch.Tensor:
    """`pinned_empty` shaped as `t`."""
    return pinned_empty(t.numel(), t.dtype).view(t.shape)
