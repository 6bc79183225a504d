"""Saved-activation offload: what autograd saves inside chosen blocks goes to host memory while the forward
runs on, and comes back one block ahead of its backward.

Each call of a chosen block runs under `torch.autograd.graph.saved_tensors_hooks`: a saved tensor of at least
`min_bytes` that is not a weight is copied, on a side CUDA stream, into pinned staging memory (one slot of
two, each one block's worth), and the device tensor is let go (`record_stream`: the allocator reuses it only
once that copy has read it). When the block returns, a host worker waits for the copies and moves the slot
into pageable host memory, freeing the slot for the block after next (double buffering: block i+1 copies into
the other slot while block i drains). In backward, the first tensor a block's backward asks for brings that
block back if it is not already, and starts bringing back the block before it (staged through a free slot,
copied on the side stream into memory allocated there): its copy runs while this block's backward computes.
The default stream waits on the copy's event before it reads a tensor brought back, and a slot is written
again only once the event of its last copy has passed. The block that runs last in forward keeps its tensors
on the device (its backward comes right after: a copy out and back could not hide), learned from the
previous forward's count.

Kept on the device: tensors under `min_bytes` (a copy's fixed cost outweighs them), parameters, views of
parameters and their autocast copies (the weights a matmul saves: the model holds them anyway), tensors on
another device, and tensors whose layout is not dense.

The staging slots are the pinned bytes this technique holds (`pinned_bytes`: two of the largest block's
saved bytes, taken through `host_buffers.host_empty`, so a tune's trials lend them on and count them in
their host peak like optimizer offload's buffers); the pageable copies (`stored_bytes`) hold every block
offloaded between a forward and its backward, and are reused from one step to the next. On a device with
no CUDA (the simulated CPU device) the same path runs with plain, synchronous copies, its host memory inside
`host_memory()`, so its gradients are testable against no offload.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...devices.ceiling import host_memory
from .host_buffers import host_empty
from .saved_tensors import MIN_BYTES, as_layout, dense, from_weight


@dataclass(kw_only=True, slots=True)
class Moved:
    """What the hooks copied to the host in the latest forward (tests read it): the number of tensors, their
    bytes, the storage address each was read from, and each one's shape and dtype."""

    tensors: int = 0
    bytes: int = 0
    storages: set[int] = field(default_factory=set)
    shapes: list[tuple[torch.Size, torch.dtype]] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class _Slot:
    """Pinned staging memory for one block: a buffer per saved-tensor position, and the worker's last job on it
    (the slot is free once that job is done)."""

    buffers: list[torch.Tensor] = field(default_factory=list)
    busy: concurrent.futures.Future[None] | None = None


@dataclass(eq=False)
class _Record:
    """One block call's saved tensors: their layouts, their device tensors where they are on the device, their
    pageable host copies, and where the copies each way stand."""

    offloaded: bool
    layouts: list[tuple[torch.Size, tuple[int, ...], torch.dtype, int]] = field(default_factory=list)
    device: list[torch.Tensor | None] = field(default_factory=list)
    left: list[int] = field(default_factory=list)  # handles not yet unpacked, per tensor
    index: dict[tuple[Any, ...], int] = field(default_factory=dict)  # the same tensor saved twice: one copy
    holding: list[torch.Tensor] = field(default_factory=list)  # until the block returns: no address reused
    stored: list[torch.Tensor] = field(default_factory=list)
    slot: _Slot | None = None
    on_host: concurrent.futures.Future[None] | None = None
    fetched: concurrent.futures.Future[None] | None = None
    arrived: torch.cuda.Event | None = None
    waited: bool = False
    backward_started: bool = False


def _done() -> concurrent.futures.Future[None]:
    future: concurrent.futures.Future[None] = concurrent.futures.Future()
    future.set_result(None)
    return future


class ActivationOffload:
    """The hooks, the two staging slots and the host copies of one model's offloaded blocks.

    Args:
        device: the device the blocks compute on.
        min_bytes: saved tensors smaller than this stay on the device.
        worker: host copies on a worker thread (None: on CUDA, where they overlap compute; on the CPU they
            run in line, unless a test asks for the worker's ordering there too).
    """

    def __init__(self, device: torch.device, *, min_bytes: int = MIN_BYTES, worker: bool | None = None) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.min_bytes = min_bytes
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # one worker, so its jobs (a block's drain, a block's fetch) run in the order they were given
        self.worker = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="autotune-activations")
                       if (self.cuda if worker is None else worker) else None)
        self.slots = (_Slot(), _Slot())
        self.turn = 0  # the slot the next copy stages through
        self.records: list[weakref.ref[_Record]] = []  # in pack order, while their tensors may be unpacked
        self.calls = 0  # offloaded-block calls in this forward
        self.per_forward = 0  # in the previous forward: its last call keeps its tensors on the device
        self.unpacked = False  # a backward ran since the last block call: the next call starts a new forward
        self.moved = Moved()
        self._free: dict[int, list[torch.Tensor]] = {}  # pageable copies given back, by size in bytes
        self._lock = threading.Lock()
        self.stored_bytes = 0

    @property
    def pinned_bytes(self) -> int:
        """The staging slots' bytes: pinned on CUDA, what the host budget counts for them."""
        return sum(b.numel() for s in self.slots for b in s.buffers)

    def wrap(self, block: nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
        """`original` (the block's forward) with its saved tensors offloaded when it runs with grad."""

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
                return original(*args, **kwargs)
            record = self._begin()
            weights = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *block.buffers())}
            hooks = torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, record, weights),
                                                              self._unpack)
            try:
                with hooks:
                    return original(*args, **kwargs)
            finally:
                self._end(record)

        return forward

    def close(self) -> None:
        """Wait for the worker's jobs and stop it; the slots go."""
        if self.worker is not None:
            self.worker.shutdown(wait=True)
        self.slots = (_Slot(), _Slot())

    # forward

    def _begin(self) -> _Record:
        if self.unpacked:
            self.per_forward, self.calls, self.unpacked = self.calls, 0, False
            self.moved = Moved()
        last = self.per_forward > 0 and self.calls == self.per_forward - 1
        self.calls += 1
        record = _Record(offloaded=not last)
        if record.offloaded:
            record.slot = self._take_slot()
        self.records = [r for r in self.records if r() is not None]
        self.records.append(weakref.ref(record))
        return record

    def _pack(self, record: _Record, weights: set[int], t: torch.Tensor) -> Any:
        if not self._movable(t, weights):
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        if key in record.index:
            i = record.index[key]
            record.left[i] += 1
            return record, i
        i = len(record.layouts)
        nbytes = t.numel() * t.element_size()
        record.index[key] = i
        record.layouts.append((t.shape, t.stride(), t.dtype, nbytes))
        record.left.append(1)
        if not record.offloaded:
            record.device.append(t)
            return record, i
        assert record.slot is not None
        compute = torch.cuda.current_stream(self.device) if self.stream is not None else None
        with host_memory(), self._side():  # (host memory: the simulated device counts none of this)
            host = as_layout(self._staging(record.slot, i, nbytes), t.shape, t.stride(), t.dtype)
            if self.stream is not None and compute is not None:
                self.stream.wait_stream(compute)  # the copy reads t once the kernel writing it is done
            host.copy_(t.detach(), non_blocking=self.cuda)
            if self.stream is not None:
                t.record_stream(self.stream)  # its memory is not reused before this copy has read it
        record.device.append(None)
        # Held until the block returns, so no later tensor of this block takes its address and its key.
        record.holding.append(t)
        self.moved.tensors += 1
        self.moved.bytes += nbytes
        self.moved.storages.add(key[0])
        self.moved.shapes.append((t.shape, t.dtype))
        return record, i

    def _movable(self, t: torch.Tensor, weights: set[int]) -> bool:
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.device != self.device:
            return False  # a parameter (its own class), a tensor subclass, another device
        if t.numel() * t.element_size() < self.min_bytes or not dense(t):
            return False
        return t.untyped_storage().data_ptr() not in weights and not from_weight(t)

    def _end(self, record: _Record) -> None:
        slot = record.slot
        if slot is None:
            return
        record.holding = []  # the copies have read them (record_stream): the device may reuse their memory
        with host_memory():
            record.stored = [self._take_stored(n) for *_, n in record.layouts]
        arrived = self._event()
        with host_memory():
            staged = [b[:n] for b, (*_, n) in zip(slot.buffers, record.layouts)]

        def drain() -> None:
            if arrived is not None:
                arrived.synchronize()
            with host_memory():
                for stored, buffer in zip(record.stored, staged):
                    stored.copy_(buffer)

        record.on_host = slot.busy = self._submit(drain)
        record.slot = None
        stored = record.stored
        weakref.finalize(record, self._give_back, stored)

    # backward

    def _unpack(self, packed: Any) -> torch.Tensor:
        self.unpacked = True
        if isinstance(packed, torch.Tensor):
            return packed
        record, i = packed
        if not record.backward_started:
            record.backward_started = True
            self._fetch(record)
            self._prefetch_before(record)
        self._arrive(record)
        if record.device[i] is None:  # unpacked a second time (retain_graph): brought back again
            record.fetched, record.waited = None, False
            self._fetch(record)
            self._arrive(record)
        t = record.device[i]
        assert t is not None
        record.left[i] -= 1
        if record.left[i] <= 0:
            record.device[i] = None  # autograd holds it while the node runs, and lets it go after
        return t

    def _fetch(self, record: _Record) -> None:
        """Bring `record`'s tensors back to the device through a free slot (nothing to do for a block that
        kept them)."""
        if not record.offloaded or record.fetched is not None:
            return
        slot = self._take_slot()
        for i, (*_, n) in enumerate(record.layouts):
            self._staging(slot, i, n)
        on_host = record.on_host
        layouts = list(enumerate(record.layouts))

        def fetch() -> None:
            if on_host is not None:
                on_host.result()
            with self._side():
                for i, (shape, stride, dtype, n) in layouts:
                    with host_memory():
                        staged = as_layout(slot.buffers[i][:n].copy_(record.stored[i]), shape, stride, dtype)
                    out = torch.empty_strided(shape, stride, dtype=dtype, device=self.device)
                    out.copy_(staged, non_blocking=self.cuda)
                    record.device[i] = out
            record.arrived = self._event()

        record.fetched = self._submit(fetch)

        def free() -> None:  # the slot is written again only once its copies to the device are done
            if record.arrived is not None:
                record.arrived.synchronize()

        slot.busy = self._submit(free)

    def _prefetch_before(self, record: _Record) -> None:
        """Start bringing back the nearest block before `record` still on the host."""
        alive = [r for ref in self.records if (r := ref()) is not None]
        if record not in alive:
            return
        earlier = [r for r in alive[:alive.index(record)] if r.offloaded and r.fetched is None]
        if earlier:
            self._fetch(earlier[-1])

    def _arrive(self, record: _Record) -> None:
        """Make the current stream wait for `record`'s copies to the device (once per fetch)."""
        if record.waited or not record.offloaded:
            return
        assert record.fetched is not None
        record.fetched.result()
        if self.cuda and record.arrived is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(record.arrived)
            for t in record.device:
                if t is not None:
                    t.record_stream(stream)  # allocated on the side stream, read on this one
        record.waited = True

    # slots, host copies, the worker

    def _take_slot(self) -> _Slot:
        slot = self.slots[self.turn]
        self.turn ^= 1
        if slot.busy is not None:
            slot.busy.result()  # its previous block drained, or its previous copy to the device done
            slot.busy = None
        return slot

    def _staging(self, slot: _Slot, i: int, nbytes: int) -> torch.Tensor:
        """Slot buffer `i`, grown to `nbytes` where it is smaller (the first steps only: blocks repeat)."""
        with host_memory():
            while len(slot.buffers) <= i:
                slot.buffers.append(torch.empty(0, dtype=torch.uint8))
            if slot.buffers[i].numel() < nbytes:
                slot.buffers[i] = host_empty(nbytes, torch.uint8, pin=self.cuda)
        return slot.buffers[i]

    def _take_stored(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
            self.stored_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8)

    def _give_back(self, stored: list[torch.Tensor]) -> None:
        with self._lock:
            for t in stored:
                self._free.setdefault(t.numel(), []).append(t)

    def _submit(self, job: Callable[[], None]) -> concurrent.futures.Future[None]:
        if self.worker is None:  # no CUDA: plain copies, done by the time they are asked for
            job()
            return _done()
        return self.worker.submit(job)

    def _side(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _event(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


def install(blocks: list[nn.Module], device: torch.device, *, min_bytes: int = MIN_BYTES,
            worker: bool | None = None) -> tuple[ActivationOffload, Callable[[], None]]:
    """Offload the saved tensors of `blocks` (each module's every call); returns the offload and the undo.

    Each block's current `forward` (its own, or what another technique set on the instance) is wrapped.
    `min_bytes` and `worker` as `ActivationOffload` takes them.
    """
    offload = ActivationOffload(device, min_bytes=min_bytes, worker=worker)
    had = {b: b.__dict__.get("forward") for b in blocks}
    for block in blocks:
        block.forward = offload.wrap(block, block.forward)

    def remove() -> None:
        for block, before in had.items():
            if before is None:
                block.__dict__.pop("forward", None)
            else:
                block.forward = before
        offload.close()

    return offload, remove


@contextlib.contextmanager
def offloaded(blocks: list[nn.Module], device: torch.device, *, min_bytes: int = MIN_BYTES,
              worker: bool | None = None) -> Iterator[ActivationOffload]:
    """`install` for the duration of a `with` block."""
    offload, remove = install(blocks, device, min_bytes=min_bytes, worker=worker)
    try:
        yield offload
    finally:
        remove()
