"""Large host buffers kept across a tune's trials, so a trial that differs from the last only in micro-batch
(or share) does not build them again.

Optimizer offload's biggest host buffers (the FP32 masters, the streamed engine's moments and the spare set an
overlapped step writes into) are one flat buffer each. Pinning them takes seconds for a large model: on a GPU
`pinned_empty` maps, touches and registers every page, and freeing them unregisters it all again. While
`reusing()` is in force (`search.ground.trials_on`, around every trial of a tune), `host_empty` lends a buffer
the pool already holds where one is big enough, and a trial's clean-up hands every buffer it was lent back
(`reclaim`); the pool frees them all when the tune ends. Outside `reusing()` (training) every buffer is built
and freed as before.

The pool never holds more buffers than a trial has used at once: building a new buffer drops a free one too
small to serve, so a tune's host peak stays that of its largest configuration. Only host buffers are pooled:
on the simulated device a buffer allocated outside `host_memory()` counts as device memory, which a buffer
from an earlier trial would escape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ...devices.ceiling import hosted
from .pinned import pinned_empty


@dataclass(kw_only=True, slots=True)
class BufferCounts:
    """Buffers `host_empty` built and buffers it lent again since the process started (what a test reads)."""

    built: int = 0
    reused: int = 0


COUNTS = BufferCounts()


class HostBuffers:
    """The pool: free buffers (raw bytes, pinned or not) and the ones lent to the trial running now."""

    def __init__(self) -> None:
        self.free: list[tuple[bool, torch.Tensor]] = []
        self.lent: list[tuple[bool, torch.Tensor]] = []
        self.reused_bytes = 0  # bytes lent again since the last `reclaim`: the trial's, not grown this time
        self.lent_bytes = 0  # bytes lent (built or again) since the last `reclaim`: what the lent buffers serve

    def take(self, nbytes: int, pin: bool) -> torch.Tensor:
        """`nbytes` raw bytes: the smallest free buffer that holds them, else a new one (one too small goes)."""
        fits = [b for b in self.free if b[0] == pin and b[1].numel() >= nbytes]
        if fits:
            chosen = min(fits, key=lambda b: b[1].numel())
            self._drop(chosen)
            COUNTS.reused += 1
            self.reused_bytes += nbytes
        else:
            small = [b for b in self.free if b[0] == pin]
            if small:  # freed before the new one is built: the pool grows to the largest need, not the sum
                self._drop(min(small, key=lambda b: b[1].numel()))
            chosen = (pin, pinned_empty(nbytes, torch.uint8) if pin else torch.empty(nbytes, dtype=torch.uint8))
            COUNTS.built += 1
        self.lent.append(chosen)
        self.lent_bytes += nbytes
        return chosen[1][:nbytes]

    def _drop(self, buffer: tuple[bool, torch.Tensor]) -> None:
        """Take `buffer` off the free list, found by identity: `list.remove` would compare the tensors of the
        buffers before it elementwise (an error where their sizes differ)."""
        self.free = [b for b in self.free if b is not buffer]

    def reclaim(self) -> int:
        """Every buffer lent is free again (the trial that held them has cleaned up); the bytes it was lent
        again, which its own rise in resident memory does not show."""
        self.free += self.lent
        self.lent = []
        self.lent_bytes = 0
        reused, self.reused_bytes = self.reused_bytes, 0
        return reused

    def hold(self) -> tuple[int, int]:
        """The trial that holds the lent buffers keeps them for the next (`search.kept_rung`): the bytes it
        was lent again, as `reclaim` gives them, and the bytes every buffer lent serves, which the next trial
        holds without growing."""
        reused, self.reused_bytes = self.reused_bytes, 0
        return reused, self.lent_bytes


_pool: list[HostBuffers] = []  # the pool in force, while `reusing()` is


@contextlib.contextmanager
def reusing() -> Iterator[HostBuffers]:
    """While inside, `host_empty` lends buffers from one pool; on the way out they are all freed."""
    pool = HostBuffers()
    _pool[:] = [pool]
    try:
        yield pool
    finally:
        _pool.clear()


def reclaim() -> int:
    """`HostBuffers.reclaim` of the pool in force (0 where none is)."""
    return _pool[0].reclaim() if _pool else 0


def pooling() -> bool:
    """Whether a pool is in force (`reusing()`)."""
    return bool(_pool)


def hold() -> tuple[int, int]:
    """`HostBuffers.hold` of the pool in force ((0, 0) where none is)."""
    return _pool[0].hold() if _pool else (0, 0)


def host_empty(numel: int, dtype: torch.dtype = torch.float32, *, pin: bool) -> torch.Tensor:
    """A 1-D host tensor of `numel` elements, uninitialised, pinned when `pin` (`pinned_empty`): from the pool
    in force where it is host memory, else built."""
    if not _pool or not (pin or hosted()):
        COUNTS.built += 1
        return pinned_empty(numel, dtype) if pin else torch.empty(numel, dtype=dtype)
    size = numel * torch.empty((), dtype=dtype).element_size()
    return _pool[0].take(size, pin).view(dtype)


def host_like(t: torch.Tensor, *, pin: bool) -> torch.Tensor:
    """`host_empty` shaped and typed as `t`."""
    return host_empty(t.numel(), t.dtype, pin=pin).view(t.shape)
