"""The simulated memory ceiling: the real search on a CPU, under a real byte budget.

`SimulatedCeiling` is a `TorchDispatchMode` that sees every tensor an operator creates, counts the bytes
of each distinct live storage (parameters, gradients, optimizer state and activations alike), frees them
when the storage dies (a weakref finalizer on the storage itself, so tensors held only by autograd still
count), and raises `torch.OutOfMemoryError` when the count passes the budget. Checkpointing, offload,
smaller micro-batches and BF16 lower the count for real, which is what lets CI walk the whole ladder.

Memory that an offload rung moves "to the host" is allocated inside `host_memory()`, which the ceiling
does not count against the device: on the simulated device host and device are the same RAM, so the
distinction is kept by bookkeeping, exactly where a real GPU would keep it by address space. Inside
`host_ledger()` those host bytes are counted too, in a ledger of their own, and its high-water mark over every
ceiling is what a search's trials allocated on the host at most, measured the way the device's bytes are.
Outside it they are not counted: the bookkeeping costs CPU time, which the simulated device would charge to the
offload rungs' steps.

This module stands beside `placement.py` rather than in it because it is a mechanism
of its own, with its own tests, and `placement.py` stays about facts.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..sizes import format_bytes
from ..torch_private import DispatchMode, is_traceable_wrapper_subclass, tree_leaves
from .shards import is_shard

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_state = threading.local()
class HostLedger:
    """The most bytes allocated inside `host_memory()` and live at once under one simulated ceiling."""

    peak_bytes = 0


_ledger: list[HostLedger] = []  # the ledger host bytes are counted in, while `host_ledger()` is active


@contextlib.contextmanager
def host_ledger() -> Iterator[HostLedger]:
    """While inside, simulated ceilings count what is allocated inside `host_memory()` (on the host optimizer's
    worker thread too), and the ledger yielded keeps the high-water mark."""
    ledger = HostLedger()
    _ledger[:] = [ledger]
    try:
        yield ledger
    finally:
        _ledger.clear()


def active_ceiling() -> SimulatedCeiling | None:
    """The ceiling in force on this thread, if any."""
    return getattr(_state, "ceiling", None)


@contextlib.contextmanager
def host_memory() -> Iterator[None]:
    """Allocations inside are host memory: not counted by an active simulated ceiling.

    On a real GPU this is a no-op: host tensors live on the CPU device and CUDA never sees them.
    """
    ceiling = active_ceiling()
    if ceiling is None:
        yield
        return
    ceiling._host_depth += 1
    try:
        yield
    finally:
        ceiling._host_depth -= 1


def hosted() -> bool:
    """Whether an allocation here is host memory to the ceiling in force: inside `host_memory()`, or no
    ceiling at all."""
    ceiling = active_ceiling()
    return ceiling is None or ceiling._host_depth > 0


class SimulatedCeiling(DispatchMode):
    """Counts live CPU storage bytes and raises `torch.OutOfMemoryError` above `limit_bytes`.

    Use as a context manager; `track()` the tensors that existed before it was entered (parameters,
    buffers, optimizer state, the batch) so that they count too.
    """

    def __init__(self, limit_bytes: int) -> None:
        super().__init__()
        self.limit_bytes = int(limit_bytes)
        self.current_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, tuple[int, weakref.finalize]] = {}
        self.host_bytes = 0  # live bytes allocated inside host_memory(): the host's ledger
        self._host_live: dict[int, tuple[int, weakref.finalize]] = {}
        self._host_lock = threading.RLock()  # the host optimizer's worker thread counts here too
        self._host_depth = 0
        self._outer: SimulatedCeiling | None = None
        # FSDP2 frees an all-gathered block by resizing its storage to 0 bytes (`storage.resize_(0)`, no
        # operator the hook sees) while autograd still holds the tensor: once a sharded model is seen, a
        # new peak re-reads the live storages' sizes before it counts (`_recount`).
        self._resized_in_place = False
        self._padded: dict[int, int] = {}  # storage key -> the largest rank's bytes, for a shard counted so

    # -- bookkeeping ---------------------------------------------------------------------------------
    def track(self, obj: Any) -> None:
        """Count every CPU tensor in `obj` (a tensor, module, optimizer, or nested containers of them)."""
        for t in _tensors_of(obj):
            self._count(t)

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def _count(self, t: torch.Tensor) -> None:
        shard_bytes = 0
        if is_shard(t):
            # An FSDP2 shard: this rank holds its local tensor only. The DTensor wrapper's own storage is
            # sized like the global tensor (world x the bytes held), so count the local one. `_local_tensor`,
            # not `to_local()`: this runs inside the dispatch hook, where an op would dispatch again.
            shard_bytes = _largest_shard_bytes(t)
            t = t._local_tensor
            self._resized_in_place = True
        if self._host_depth or t.device.type != "cpu" or t.is_sparse or t.is_nested:
            return
        if is_traceable_wrapper_subclass(t):
            # A wrapper (torchao's 8-bit optimizer state) holds its data in inner tensors; its own storage
            # is nominal, sized as its dtype says (FP32), and would count 8-bit state as 32-bit.
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._count(inner)
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. functional wrappers)
            return
        key = storage._cdata
        nbytes = storage.nbytes()
        if shard_bytes and nbytes == t.numel() * t.element_size():
            # A shard in a storage of its own (optimizer state): counted at the largest rank's size, as FSDP
            # pads its own buffers. Uneven shards (a dimension smaller than the world) would otherwise let
            # one rank run out of memory inside a forward where the others go on into a collective.
            nbytes = max(nbytes, shard_bytes)
            self._padded[key] = nbytes
        seen = self._live.get(key)
        if seen is not None:
            if seen[0] != nbytes:  # resized in place (out= ops, resize_)
                self.current_bytes += nbytes - seen[0]
                self._live[key] = (nbytes, seen[1])
            return
        finalizer = weakref.finalize(storage, self._release, key)
        finalizer.atexit = False
        self._live[key] = (nbytes, finalizer)
        self.current_bytes += nbytes

    def count_host_outputs(self, out: Any) -> None:
        """Count every tensor of an operator's output `out` in the host's ledger."""
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count_host(t)

    def _count_host(self, t: torch.Tensor) -> None:
        """Count `t`'s storage in the host's ledger (an output made inside `host_memory()`), once."""
        if is_shard(t):
            t = t._local_tensor
        if t.device.type != "cpu" or t.is_sparse or t.is_nested or is_traceable_wrapper_subclass(t):
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key, nbytes = storage._cdata, storage.nbytes()
        if key in self._live:  # a view of device memory, already counted there
            return
        with self._host_lock:
            seen = self._host_live.get(key)
            if seen is None:
                finalizer = weakref.finalize(storage, self._release_host, key)
                finalizer.atexit = False
                self._host_live[key] = (nbytes, finalizer)
                self.host_bytes += nbytes
            elif seen[0] != nbytes:
                self._host_live[key] = (nbytes, seen[1])
                self.host_bytes += nbytes - seen[0]
            if _ledger:
                _ledger[0].peak_bytes = max(_ledger[0].peak_bytes, self.host_bytes)

    def _release_host(self, key: int) -> None:
        with self._host_lock:
            entry = self._host_live.pop(key, None)
            if entry is not None:
                self.host_bytes -= entry[0]

    def _release(self, key: int) -> None:
        self._padded.pop(key, None)
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current_bytes -= entry[0]

    def _recount(self) -> None:
        """Re-read every live storage's size: those resized outside an operator (FSDP2's frees)."""
        for key, (nbytes, finalizer) in list(self._live.items()):
            alive = finalizer.peek()
            size = max(alive[0].nbytes(), self._padded.get(key, 0)) if alive is not None else nbytes
            if size != nbytes:
                self.current_bytes += size - nbytes
                self._live[key] = (size, finalizer)

    def _check(self) -> None:
        if self._resized_in_place and self.current_bytes > self.peak_bytes:
            self._recount()
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
        if self.current_bytes > self.limit_bytes:
            raise torch.OutOfMemoryError(
                f"simulated ceiling: {format_bytes(self.current_bytes)} live, over the "
                f"{format_bytes(self.limit_bytes)} budget (autotune's CPU stand-in for CUDA out of memory)")

    # -- the dispatch hook ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature, unannotated
        out = func(*args, **(kwargs or {}))
        if self._host_depth:
            if _ledger:
                self.count_host_outputs(out)
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t)
        self._check()
        return out

    # -- context -------------------------------------------------------------------------------------
    def __enter__(self) -> SimulatedCeiling:
        self._outer = active_ceiling()
        _state.ceiling = self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            _state.ceiling = self._outer
            self._outer = None

    def close(self) -> None:
        """Detach every finalizer so storages that outlive the ceiling do not keep it alive."""
        with self._host_lock:
            for _, finalizer in [*self._live.values(), *self._host_live.values()]:
                finalizer.detach()
            self._live.clear()
            self._host_live.clear()
            self._padded.clear()
            self.current_bytes = self.host_bytes = 0


class _HostThreadCounter(DispatchMode):
    """On a thread that only works on host memory (the host optimizer's worker), counts every tensor its
    operators create in a ceiling's host ledger. Dispatch modes are per thread, so the ceiling itself does not
    see that thread."""

    def __init__(self, ceiling: SimulatedCeiling) -> None:
        super().__init__()
        self.ceiling = ceiling

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature, unannotated
        out = func(*args, **(kwargs or {}))
        self.ceiling.count_host_outputs(out)
        return out


def counting_host_on_this_thread(ceiling: SimulatedCeiling | None) -> contextlib.AbstractContextManager[Any]:
    """For a worker thread doing host work: count what it allocates in `ceiling`'s host ledger (the ceiling
    of the thread that started it, read there with `active_ceiling()`); nothing without a ceiling, or outside
    `host_ledger()`."""
    return _HostThreadCounter(ceiling) if ceiling is not None and _ledger else contextlib.nullcontext()


def _largest_shard_bytes(t: DTensor) -> int:
    """Bytes of the largest rank's shard of `t`: dimension d of a `Shard(d)` placement split by ceiling."""
    shape = list(t.shape)
    for size, placement in zip(t.device_mesh.shape, t.placements):
        if placement.is_shard():
            dim = placement.dim  # type: ignore[attr-defined]
            shape[dim] = -(-shape[dim] // size)
    return math.prod(shape) * t.element_size()


def _tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.is_leaf and obj.grad is not None:  # a view of an input is no leaf: .grad would warn
            yield obj.grad
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            yield from _tensors_of(p)
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from _tensors_of(list(state.values()))
    elif isinstance(obj, Mapping):  # a dict, or a tokenizer's BatchEncoding
        for v in obj.values():
            yield from _tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_of(v)
