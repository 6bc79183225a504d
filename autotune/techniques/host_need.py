"""What a configuration holds in host memory, computed before it runs.

Under optimizer offload each parameter of the host share keeps, on the host: its master (FP32, or its own
dtype when wider), the master's gradient (same size; not where the GPU steps the share, which reads the device
gradients), the optimizer's state (`state_tensors` parameter-sized tensors, two for AdamW), on CUDA a 16-bit
staging copy for the overlapped CPU step, and for the streamed step overlapped with backward a second set of
master and moments (the step writes into it, so an attempt that runs out of memory half-way leaves the first
intact). Partitioned over replicated ranks, each rank holds 1/world of that. Every configuration of a tune
also holds `fit`'s copy of the model, to put it back afterwards.

The figures are what the engines allocate (its large buffers pinned at their exact size:
`offload/pinned.py`), so a configuration over the host budget is refused before it allocates anything (the
process is never left to the kernel's OOM killer).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import psutil
import torch
from torch import nn

from .offload import host_share, local_part, master_dtype


@dataclass(frozen=True, kw_only=True, slots=True)
class HostNeed:
    """Host bytes of one configuration, by what holds them."""

    masters: int = 0  # FP32 masters of the host share
    gradients: int = 0  # their FP32 gradients
    state: int = 0  # the optimizer's state of the host share
    staging: int = 0  # 16-bit staging copies (the overlapped CPU step on CUDA)
    overlap: int = 0  # the streamed step's second set of masters and moments
    snapshot: int = 0  # fit's copy of the model, held for the whole tune

    @property
    def total(self) -> int:
        return self.masters + self.gradients + self.state + self.staging + self.overlap + self.snapshot

    def describe(self) -> str:
        """The non-zero parts, largest first, e.g. "masters 2.9 GiB, state 5.8 GiB"."""
        from ..sizes import format_bytes

        parts = [(n, getattr(self, n)) for n in ("masters", "gradients", "state", "staging", "overlap", "snapshot")]
        return ", ".join(f"{name} {format_bytes(b)}" for name, b in sorted(parts, key=lambda p: -p[1]) if b)


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers as they are: what a snapshot of it copies to the host."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def offload_need(params: Sequence[nn.Parameter], *, fraction: float, state_tensors: int, cuda: bool,
                 streamed: bool, overlap: bool, ranks: int = 1) -> HostNeed:
    """Host bytes optimizer offload of `fraction` of `params` allocates (see the module docstring).

    `streamed`: the GPU steps the host share (its moments in the stepper's buffers, no staging copies);
    `overlap`: that step overlaps backward (a second set); `ranks`: the partition's width (1: not partitioned).
    """
    numels = [p.numel() for p in params]
    share = [params[i] for i in host_share(numels, fraction)]
    if not share:
        return HostNeed()
    # an FSDP2 shard's master is this rank's part
    widths = [(local_part(p).numel(), torch.empty((), dtype=master_dtype(p)).element_size()) for p in share]
    masters = sum(n * w for n, w in widths) // ranks
    elements = sum(n for n, _ in widths) // ranks
    staging = 2 * elements if cuda and not streamed and overlap else 0
    second = (masters + 2 * 4 * elements) if streamed and overlap else 0
    gradients = 0 if streamed else masters  # the streamed step widens the device gradients on the device
    return HostNeed(masters=masters, gradients=gradients, state=state_tensors * 4 * elements, staging=staging,
                    overlap=second)


SNAPSHOT_TO_DISK_FROM = 8 << 30  # a model on a GPU this large is copied to a temporary file, not to RAM


def snapshot_on_disk(model: nn.Module) -> bool:
    """Whether fit's copy of `model` goes to a temporary file: a model on a GPU of `SNAPSHOT_TO_DISK_FROM` bytes
    or more, where the temporary folder is on a disk (not tmpfs) with room for it. Its RAM is then the
    optimizer's to use: an 8B model's FP32 copy alone would take a quarter of a 128 GiB host, and offload
    needs the host for its share."""
    size = model_bytes(model)
    on_gpu = any(p.device.type == "cuda" for p in model.parameters())
    if not on_gpu or size < SNAPSHOT_TO_DISK_FROM:
        return False
    folder = tempfile.gettempdir()
    return not in_memory_filesystem(folder) and shutil.disk_usage(folder).free > 1.1 * size


def in_memory_filesystem(path: str) -> bool:
    """Whether `path` lies on tmpfs or ramfs, whose files take RAM: a snapshot there would spend the host memory
    it is meant to spare (set TMPDIR to a folder on disk)."""
    real = os.path.realpath(path)
    mounts = [m for m in psutil.disk_partitions(all=True) if real == m.mountpoint or real.startswith(
        m.mountpoint.rstrip("/") + "/")]
    mount = max(mounts, key=lambda m: len(m.mountpoint), default=None)
    return mount is not None and mount.fstype in ("tmpfs", "ramfs")


def with_snapshot(need: HostNeed, model: nn.Module) -> HostNeed:
    """`need` plus fit's copy of `model` in RAM (the caller leaves it out where the copy went to disk)."""
    return HostNeed(masters=need.masters, gradients=need.gradients, state=need.state, staging=need.staging,
                    overlap=need.overlap, snapshot=model_bytes(model))
