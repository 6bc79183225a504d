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


class _DiskCopies:
    """Tensors' values in an unnamed temporary file, written one tensor at a time (one on the host at once)."""

    def __init__(self) -> None:
        self.file: IO[bytes] = tempfile.TemporaryFile(prefix="autotune-snapshot-")
        self.size = 0

    def save(self, t: torch.Tensor) -> _Stored:
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self.file.seek(self.size)
        self.file.write(raw.data)  # the array's own bytes, not a copy of them
        stored = _Stored(self.size, t.dtype, t.shape)
        self.size += raw.nbytes
        return stored

    def load(self, stored: _Stored) -> torch.Tensor:
        nbytes = stored.shape.numel() * torch.empty((), dtype=stored.dtype).element_size()
        self.file.seek(stored.offset)
        data = bytearray(nbytes)
        if self.file.readinto(data) != nbytes:  # type: ignore[attr-defined]
            raise OSError(f"the snapshot's file ended before {nbytes} bytes at {stored.offset}")
        return torch.frombuffer(data, dtype=torch.uint8).view(stored.dtype).view(stored.shape)


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
                    saved = self.disk.load(saved)
                live.copy_(saved)


def _copy_state(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _copy_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_copy_state(v) for v in state]
    return state
