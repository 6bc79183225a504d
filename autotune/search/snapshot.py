"""Snapshot and restore what trials may disturb: weights, buffers, gradients, train/eval flags, RNG state.

`fit` takes a snapshot first and restores it in `finally`, so the model, the user's optimizer and the
random streams are exactly as they were, whatever the trials did or raised. The weights and buffers of a
large model on a GPU are copied to an unnamed temporary file rather than to RAM (`host_need.snapshot_on_disk`):
the host memory is then the offloaded optimizer's, and the file is gone when the snapshot is.
"""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass
from typing import IO, Any

import torch
from torch import nn

from ..techniques.offload import local_part


@dataclass(frozen=True, slots=True)
class _Stored:
    """Where one tensor's bytes lie in the snapshot's file."""

    offset: int
    dtype: torch.dtype
    shape: torch.Size


STAGE_BYTES = 64 << 20  # one staging buffer: large enough that a copy's fixed cost is noise, small to pin


class _DiskCopies:
    """Tensors' values in an unnamed temporary file, moved through two staging buffers (page-locked for a GPU
    tensor) a chunk at a time: a device copy into one buffer runs while the other is written to or read from
    the file, and no whole tensor is ever on the host. A pageable copy of a large model instead allocates and
    faults in every tensor's host pages on the way out and again on the way back."""

    def __init__(self) -> None:
        self.file: IO[bytes] = tempfile.TemporaryFile(prefix="autotune-snapshot-")
        self.size = 0
        self._stage_bytes = STAGE_BYTES
        # pinned or not: two buffers each, made when first needed and dropped after each pass over the model,
        # so trials never run beside them
        self._stages: dict[bool, list[torch.Tensor]] = {}

    def save(self, t: torch.Tensor) -> _Stored:
        stored = _Stored(self.size, t.dtype, t.shape)
        flat = _bytes_of(t.detach().contiguous())
        self.file.seek(self.size)
        pending: tuple[torch.Tensor, Any] | None = None  # a filled buffer not yet written, and its copy's event
        for i, chunk in enumerate(self._chunks(flat)):
            buffer = self._stage(flat.is_cuda, i)[: chunk.numel()]
            buffer.copy_(chunk, non_blocking=flat.is_cuda)
            done = _event_after_copy(flat.is_cuda)
            if pending is not None:
                self._write(*pending)
            pending = (buffer, done)
        if pending is not None:
            self._write(*pending)
        self.size += flat.numel()
        return stored

    def load_into(self, stored: _Stored, live: torch.Tensor) -> None:
        """`live`'s values from the file: chunks read into one buffer while the other's copy to `live` runs."""
        if live.dtype != stored.dtype or live.shape != stored.shape or not live.is_contiguous():
            live.copy_(self.load(stored))
            return
        flat = _bytes_of(live)
        self.file.seek(stored.offset)
        copies: list[Any] = [None, None]  # each buffer's last copy to the device, waited on before refilling it
        for i, chunk in enumerate(self._chunks(flat)):
            buffer = self._stage(flat.is_cuda, i)[: chunk.numel()]
            if copies[i % 2] is not None:
                copies[i % 2].synchronize()
            self._read(buffer, stored.offset)
            chunk.copy_(buffer, non_blocking=flat.is_cuda)
            copies[i % 2] = _event_after_copy(flat.is_cuda)
        for done in copies:
            if done is not None:
                done.synchronize()

    def load(self, stored: _Stored) -> torch.Tensor:
        """A tensor's values as a new host tensor (where the live one no longer matches its dtype or shape)."""
        nbytes = stored.shape.numel() * torch.empty((), dtype=stored.dtype).element_size()
        self.file.seek(stored.offset)
        data = torch.empty(nbytes, dtype=torch.uint8)
        self._read(data, stored.offset)
        return data.view(stored.dtype).view(stored.shape)

    def release(self) -> None:
        """Drop the staging buffers (the next save or load makes them again)."""
        self._stages.clear()

    def _chunks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[i: i + self._stage_bytes] for i in range(0, flat.numel(), self._stage_bytes)]

    def _stage(self, pinned: bool, i: int) -> torch.Tensor:
        if pinned not in self._stages:
            self._stages[pinned] = [torch.empty(self._stage_bytes, dtype=torch.uint8, pin_memory=pinned)
                                    for _ in range(2)]
        return self._stages[pinned][i % 2]

    def _write(self, buffer: torch.Tensor, done: Any) -> None:
        if done is not None:
            done.synchronize()
        self.file.write(buffer.numpy().data)  # the buffer's own bytes, not a copy of them

    def _read(self, buffer: torch.Tensor, offset: int) -> None:
        if self.file.readinto(buffer.numpy().data) != buffer.numel():  # type: ignore[attr-defined]
            raise OSError(f"the snapshot's file ended before the tensor stored at {offset}")


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat byte tensor on its own device (a view, no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _event_after_copy(cuda: bool) -> Any:
    """An event marking the copies issued so far on the current stream (None on the host: its copies are done)."""
    if not cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


@dataclass(kw_only=True, slots=True)
class Snapshot:
    tensors: list[tuple[torch.Tensor, torch.Tensor | _Stored]]  # (live tensor, host copy of its values or its place)
    disk: _DiskCopies | None  # the file holding them, where they went to disk
    grads: list[tuple[nn.Parameter, torch.Tensor | None]]
    dtypes: list[tuple[nn.Parameter, torch.dtype]]
    modes: list[tuple[nn.Module, bool]]
    optimizer_state: dict[str, Any] | None
    optimizer: torch.optim.Optimizer | None
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    python_rng: Any

    @classmethod
    def take(cls, model: nn.Module, optimizer: Any = None, *, to_disk: bool = False) -> Snapshot:
        """The snapshot of `model` (and `optimizer`), its weights and buffers in a temporary file where `to_disk`
        (`host_need.snapshot_on_disk`, decided once per tune: the file itself takes the disk room it asks for)."""
        with torch.no_grad():
            # An FSDP2 shard is saved and restored as this rank's local tensor (a plain tensor on the host);
            # any other tensor as itself (restore() may give it new data of the first dtype before copying).
            live = [local_part(t) for t in [*model.parameters(), *model.buffers()]]
            disk = _DiskCopies() if to_disk else None
            tensors = [(t, disk.save(t) if disk is not None else t.to("cpu", copy=True)) for t in live]
            if disk is not None:
                disk.release()
        user_opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        snapshot = cls(
            tensors=tensors,
            disk=disk,
            grads=[(p, p.grad) for p in model.parameters()],
            dtypes=[(p, p.dtype) for p in model.parameters()],
            modes=[(m, m.training) for m in model.modules()],
            optimizer_state=_copy_state(user_opt.state_dict()) if user_opt is not None else None,
            optimizer=user_opt,
            cpu_rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
            python_rng=random.getstate(),
        )
        # Trials start without gradients: backward would otherwise accumulate into the user's own
        # gradient tensors. The originals are put back by restore().
        for p in model.parameters():
            p.grad = None
        return snapshot

    def restore(self) -> None:
        self.restore_values()
        for p, grad in self.grads:
            p.grad = grad
        for module, training in self.modes:
            module.training = training
        if self.optimizer is not None and self.optimizer_state is not None:
            self.optimizer.load_state_dict(self.optimizer_state)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.python_rng)


    def restore_values(self) -> None:
        """The weights' and buffers' values (and dtypes) alone, wherever the model is now: between trials, after
        one whose NaN or infinite loss left them NaN; gradients, modes, optimizer and RNG are left as they are."""
        with torch.no_grad():
            for (p, dtype) in self.dtypes:
                if p.dtype != dtype:  # an offload rung that failed half-way left 16-bit weights
                    p.data = p.data.to(dtype)
            for live, saved in self.tensors:
                if isinstance(saved, _Stored):
                    assert self.disk is not None, "a tensor stored on disk without the snapshot's file"
                    self.disk.load_into(saved, live)
                else:
                    live.copy_(saved)
            if self.disk is not None:
                self.disk.release()


def _copy_state(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _copy_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_copy_state(v) for v in state]
    return state
