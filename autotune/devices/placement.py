"""Device facts: which device, how much memory this process may use, and how to read its peak.

`Placement` says where training runs. On CUDA, memory is read from the caching allocator (reserved,
allocated, retries) plus what the allocator does not see (the CUDA context, cuBLAS workspaces) as
pynvml reports it. On the CPU, the same questions are answered by the simulated ceiling (`ceiling.py`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import torch

from .. import torch_private
from ..errors import DeviceError, InvalidSetting
from ..sizes import format_bytes
from . import host as host_memory
from . import nvml
from .ceiling import SimulatedCeiling

_GIB = 1 << 30


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where trials and training run."""

    kind: str  # "cuda" | "cpu"
    index: int = 0
    name: str = ""  # the name the driver reports, or "cpu (simulated ceiling)"
    total_bytes: int = 0

    @property
    def simulated(self) -> bool:
        return self.kind == "cpu"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.index) if self.kind == "cuda" else torch.device("cpu")


def resolve_device(device: str | torch.device | None) -> Placement:
    """`None` means CUDA when available, else the CPU under a simulated ceiling."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidSetting(f"device={device!r} is not a device; pass 'cuda', 'cuda:1' or 'cpu'") from exc
    if dev.type == "cpu":
        return Placement(kind="cpu", name="cpu (simulated ceiling)", total_bytes=psutil.virtual_memory().total)
    if dev.type != "cuda":
        raise InvalidSetting(f"device={device!r}: autotune runs on 'cuda' devices, or 'cpu' to simulate one")
    if not torch.cuda.is_available():
        raise DeviceError(f"device={device!r} but torch sees no CUDA GPU (torch {torch.__version__}, "
                          f"CUDA build {torch.version.cuda}); pass device='cpu' to run under a simulated ceiling")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise InvalidSetting(f"device={device!r} but only {torch.cuda.device_count()} GPU(s) are visible")
    props = torch.cuda.get_device_properties(index)
    return Placement(kind="cuda", index=index, name=props.name, total_bytes=props.total_memory)


def refuse_meta(model: torch.nn.Module) -> None:
    """Raise `InvalidSetting` when the model has tensors on the `meta` device: shapes without data, which
    nothing can train or measure (and `.to()` cannot copy)."""
    names = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise InvalidSetting(f"model has tensors on the 'meta' device ({shown}): they have shapes but no data. "
                             "Materialize the model first, e.g. model.to_empty(device='cuda') then initialize or "
                             "load the weights (model.load_state_dict(state, assign=True)), and pass it again")


def default_budget(placement: Placement) -> tuple[int, str]:
    """Bytes this process may use on `placement`, and where the figure came from."""
    if placement.simulated:
        available = psutil.virtual_memory().available
        return available, "host memory available (no memory_budget given for the CPU)"
    fraction = _memory_fraction(placement.index)
    free, total = torch.cuda.mem_get_info(placement.index)
    # What this process already holds in its cache counts as available to it.
    free += torch.cuda.memory_reserved(placement.index) - torch.cuda.memory_allocated(placement.index)
    if fraction < 1.0:
        return int(min(free, fraction * total)), f"per-process memory fraction {fraction:g} of {placement.name}"
    # Free memory moves by a few MiB from one process to the next (another process's context, a driver's
    # pool): rounded down to whole GiB, the default budget, and with it the plan cache's key, holds across runs.
    return max(_GIB, int(free) // _GIB * _GIB), f"free memory on {placement.name}, rounded down to whole GiB"


def check_budget(budget: int, total_bytes: int, device_name: str, setting: str = "memory_budget") -> int:
    """`budget`, unless it is more than the device has: then an `InvalidSetting` naming the device's size.

    A budget over the device would make every plan "fit" on paper and run out of memory in training. On
    the CPU the simulated ceiling stands in for a GPU in host RAM, so host RAM is the device's size there.
    """
    if total_bytes and budget > total_bytes:
        raise InvalidSetting(f"{setting} {format_bytes(budget)} is over the device's memory: {device_name} has "
                             f"{format_bytes(total_bytes)}{' of host RAM' if 'cpu' in device_name else ''}; pass "
                             f"at most {format_bytes(total_bytes)}, or leave {setting} out to use what the device "
                             "can give")
    return budget


def _memory_fraction(index: int) -> float:
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is None:
        return 1.0
    try:
        return float(getter(index))
    except (RuntimeError, TypeError):
        return 1.0


def bf16_supported(placement: Placement) -> bool:
    """Whether the device runs bf16 at speed: a CUDA GPU that supports it, or a CPU with native bf16."""
    if placement.simulated:
        return cpu_has_native_bf16()
    return torch.cuda.is_bf16_supported()


# CPU features that run bf16 matrix products natively: x86's AVX512-BF16 and AMX, Arm's BF16 extension. On a
# CPU without them torch emulates bf16 autocast, several times slower than fp32, so a plan there stays in fp32.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
NO_NATIVE_BF16 = "this CPU has no native bf16 (AVX512-BF16, AMX or Arm BF16): bf16 would be emulated, slower than fp32"


@functools.cache
def cpu_has_native_bf16(flags: str | None = None) -> bool:
    """Whether this CPU (or one with the feature `flags` given, as /proc/cpuinfo lists them) has native bf16."""
    return bool(NATIVE_BF16_FLAGS & set((_cpu_flags() if flags is None else flags).split()))


def _cpu_flags() -> str:
    """The CPU's feature flags: /proc/cpuinfo's on Linux, the Arm features sysctl names on macOS."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            return " ".join(line.split(":", 1)[1] for line in f if line.startswith(("flags", "Features")))
    if platform.system() == "Darwin":
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True,
                                 timeout=5).stdout.strip()
            return "bf16" if out == "1" else ""
    return ""


# -- measuring a trial's memory ---------------------------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class MemoryReading:
    peak_bytes: int  # what counts against the budget
    allocated_peak_bytes: int
    alloc_retries: int


class MemoryMeter:
    """Measures one trial's peak: the simulated ceiling on the CPU, the caching allocator on CUDA."""

    def __init__(self, placement: Placement, budget_bytes: int) -> None:
        self.placement = placement
        self.budget_bytes = budget_bytes
        self.ceiling: SimulatedCeiling | None = None
        self._retries0 = 0
        self._outside_allocator = 0
        self._sim_peak = 0

    @contextlib.contextmanager
    def watching(self, *existing: object) -> Iterator[MemoryMeter]:
        """Count from here; `existing` are objects already in device memory (model, optimizer, batch)."""
        if self.placement.simulated:
            self.ceiling = SimulatedCeiling(self.budget_bytes)
            with self.ceiling:
                self.ceiling.track(list(existing))
                try:
                    yield self
                finally:
                    self._sim_peak = self.ceiling.peak_bytes
                    self.ceiling.close()  # detach finalizers: storages outliving the trial must not pin it
            return
        idx = self.placement.index
        torch.cuda.synchronize(idx)
        torch.cuda.reset_peak_memory_stats(idx)
        self._retries0 = torch.cuda.memory_stats(idx).get("num_alloc_retries", 0)
        self._outside_allocator = outside_allocator_bytes(idx)
        yield self

    def reset_peak(self) -> None:
        if self.ceiling is not None:
            self.ceiling.reset_peak()
        else:
            torch.cuda.reset_peak_memory_stats(self.placement.index)

    def read(self) -> MemoryReading:
        if self.ceiling is not None:
            peak = max(self._sim_peak, self.ceiling.peak_bytes)
            return MemoryReading(peak_bytes=peak, allocated_peak_bytes=peak, alloc_retries=0)
        idx = self.placement.index
        stats = torch.cuda.memory_stats(idx)
        return MemoryReading(
            peak_bytes=torch.cuda.max_memory_reserved(idx) + self._outside_allocator,
            allocated_peak_bytes=torch.cuda.max_memory_allocated(idx),
            alloc_retries=stats.get("num_alloc_retries", 0) - self._retries0,
        )


def outside_allocator_bytes(index: int) -> int:
    """Device memory this process holds that PyTorch's allocator does not count (context, libraries).

    Read from pynvml's per-process figure minus torch's reserved bytes; 0 when pynvml cannot say
    (no driver access, or a container that hides process lists).
    """
    used = nvml.process_bytes(index, os.getpid())
    if used is None:
        return 0
    # A budget set with set_per_process_memory_fraction covers the allocator only; the context lies
    # outside it, so counting it against the budget errs on the side of headroom.
    return max(0, used - torch.cuda.memory_reserved(index))


def release_memory(placement: Placement, *, reset_peak: bool = False) -> None:
    """Wait for queued work and give the allocator's cached blocks back (after a trial or a failed step).

    On the simulated device only the host's part: freed heap memory back to the OS. Never call it after a
    device-side assert or an illegal address: on a poisoned context every CUDA call fails again, and its
    error would hide the first one.
    """
    host_memory.give_back()
    if placement.simulated:
        return
    torch.cuda.synchronize(placement.index)
    torch.cuda.empty_cache()
    # Pinned host blocks a trial freed stay cached by torch's host allocator, and a tune that tries offload at
    # several shares would hold the sum of them: give them back, so its host peak is its largest configuration.
    torch_private.empty_host_cache()
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(placement.index)


def synchronize(placement: Placement) -> None:
    if not placement.simulated:
        torch.cuda.synchronize(placement.index)


def now(placement: Placement) -> float:
    """A wall-clock reading after the device has finished queued work."""
    synchronize(placement)
    return time.perf_counter()
