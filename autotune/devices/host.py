"""Host memory: what this process may use, and what it uses now.

Plans that save the GPU spend the host (optimizer offload keeps FP32 masters, gradients and moments there;
activation offload parks block inputs there; `fit` keeps a copy of the model to put back). The host is a
budget beside the device's: `fit(host_memory_budget=...)`, by default what this process may use, which is the
smaller of the machine's available memory and what its cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`)
still allows, less a margin the page cache and the interpreter need.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from pathlib import Path
from typing import Any

import psutil

HOST_MARGIN = 0.10  # of the usable memory: the page cache, the allocator's slack, the interpreter's growth
_CGROUP_V2 = Path("/sys/fs/cgroup")
_CGROUP_V1 = Path("/sys/fs/cgroup/memory")
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge number near 2**63


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value < _UNLIMITED else None


def cgroup_room(root_v2: Path = _CGROUP_V2, root_v1: Path = _CGROUP_V1) -> int | None:
    """Bytes this process's cgroup still allows (its limit less its usage), or None where no limit is set.

    The roots are parameters so that tests can point them at a fake cgroup tree."""
    limit, used = _cgroup_limit_and_usage(root_v2, root_v1)
    if limit is None:
        return None
    return max(0, limit - (used or 0))


def _cgroup_limit_and_usage(root_v2: Path, root_v1: Path) -> tuple[int | None, int | None]:
    """This process's cgroup memory limit and usage (v2, else v1); (None, None) where no limit is set."""
    limit, used = _read_int(root_v2 / "memory.max"), _read_int(root_v2 / "memory.current")
    if limit is None:
        limit, used = _read_int(root_v1 / "memory.limit_in_bytes"), _read_int(root_v1 / "memory.usage_in_bytes")
    return limit, used


def total_bytes() -> int:
    """The machine's memory as this process sees it: physical RAM, capped by its cgroup's limit."""
    limit, _ = _cgroup_limit_and_usage(_CGROUP_V2, _CGROUP_V1)
    total = psutil.virtual_memory().total
    return total if limit is None else min(total, limit)


def available_bytes() -> int:
    """Host memory this process could still allocate: the machine's available memory, capped by the cgroup."""
    room = cgroup_room()
    free = psutil.virtual_memory().available
    return free if room is None else min(free, room)


def resident_bytes() -> int:
    """This process's resident set now (pinned host memory is resident too)."""
    return psutil.Process(os.getpid()).memory_info().rss


def default_budget() -> int:
    """What a plan may add to this process's host memory by default: what is available, less `HOST_MARGIN`."""
    return int(available_bytes() * (1 - HOST_MARGIN))


def give_back() -> None:
    """Return the C heap's free memory to the OS (glibc's `malloc_trim`; nothing where there is none).

    After a trial frees its host buffers, glibc keeps large freed blocks in the heap for reuse (its mmap
    threshold grows with the sizes it has seen), so the process would stay as large as its largest trial
    and the next trial's rise would not show its own buffers."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:  # a ctypes function, or None where the C library has none
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


class ResidentPeak:
    """How far this process's resident memory rose over a stretch of work, as the kernel measured it.

    Linux keeps a high-water mark of the resident set (`VmHWM`), which writing 5 to /proc/self/clear_refs
    resets to the current size; the peak is then exact however briefly it lasted (pinned host buffers are
    resident too). Where that file cannot be written, the resident size at the end stands in for the peak."""

    def __init__(self) -> None:
        self.start = resident_bytes()
        self.exact = _reset_high_water()

    def grown(self) -> int:
        """Bytes the peak rose above the resident size at the start (0 where it did not)."""
        peak = _high_water() if self.exact else None
        return max(0, (peak if peak is not None else resident_bytes()) - self.start)


def _reset_high_water() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _high_water() is not None


def _high_water() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
