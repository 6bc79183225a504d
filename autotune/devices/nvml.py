"""What the NVIDIA driver says, through pynvml: GPUs, their memory and processes, and a memory sampler.

Used by `autotune doctor` and by the `autotune run` supervisor. Nothing here initialises CUDA (a CUDA
context costs hundreds of MiB on the very GPU the job needs); NVML reads the driver directly. Every
function degrades to "nothing known" on a machine without an NVIDIA driver: `available()` says why.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .sampler import Sampler

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuProcess:
    pid: int
    used_bytes: int | None  # None where the driver hides it (some containers)
    name: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Gpu:
    index: int  # NVML index (physical order, not CUDA_VISIBLE_DEVICES order)
    name: str
    total_bytes: int
    free_bytes: int
    used_bytes: int
    compute_capability: tuple[int, int] | None
    processes: tuple[GpuProcess, ...] = field(default_factory=tuple)

    @property
    def bf16(self) -> bool | None:
        """BF16 tensor cores arrived with Ampere (compute capability 8.0); None when unknown."""
        return None if self.compute_capability is None else self.compute_capability >= (8, 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class DriverFacts:
    ok: bool
    problem: str = ""  # why NVML is unusable, e.g. "NVML Shared Library Not Found"
    driver_version: str = ""
    cuda_driver_version: str = ""  # the newest CUDA the driver supports, e.g. "12.8"
    gpus: tuple[Gpu, ...] = field(default_factory=tuple)

    @property
    def no_driver(self) -> bool:
        """No NVIDIA driver in use at all (library absent, or not loaded), as opposed to one that fails."""
        return any(m in self.problem for m in ("Not Found", "No module named", "Driver Not Loaded"))


@contextmanager
def _session() -> Iterator[Any]:
    import pynvml

    pynvml.nvmlInit()
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def driver_facts(with_processes: bool = True) -> DriverFacts:
    """Driver version and every GPU NVML sees; `ok=False` with the reason when NVML cannot be used."""
    try:
        with _session() as nv:
            return DriverFacts(ok=True, driver_version=_text(nv.nvmlSystemGetDriverVersion()),
                               cuda_driver_version=_cuda_version(nv),
                               gpus=tuple(_gpu(nv, i, with_processes) for i in range(nv.nvmlDeviceGetCount())))
    except Exception as exc:  # noqa: BLE001 - pynvml raises its NVMLError family, ImportError, OSError
        return DriverFacts(ok=False, problem=f"{type(exc).__name__}: {exc}")


def _gpu(nv: Any, index: int, with_processes: bool) -> Gpu:
    handle = nv.nvmlDeviceGetHandleByIndex(index)
    mem = nv.nvmlDeviceGetMemoryInfo(handle)
    try:
        cc: tuple[int, int] | None = tuple(nv.nvmlDeviceGetCudaComputeCapability(handle))
    except Exception:  # noqa: BLE001 - old drivers lack the call
        cc = None
    procs = _processes(nv, handle) if with_processes else ()
    return Gpu(index=index, name=_text(nv.nvmlDeviceGetName(handle)), total_bytes=int(mem.total),
               free_bytes=int(mem.free), used_bytes=int(mem.used), compute_capability=cc, processes=procs)


def _processes(nv: Any, handle: object) -> tuple[GpuProcess, ...]:
    try:
        procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception as exc:  # noqa: BLE001 - containers may deny the process list
        log.debug("NVML process list unavailable: %s", exc)
        return ()
    return tuple(GpuProcess(pid=int(p.pid), used_bytes=_used(p), name=_process_name(int(p.pid))) for p in procs)


def _used(proc: object) -> int | None:
    used = getattr(proc, "usedGpuMemory", None)
    return int(used) if used is not None else None


def _process_name(pid: int) -> str:
    try:
        import psutil

        return psutil.Process(pid).name()
    except Exception:  # noqa: BLE001 - the process may live in another PID namespace, or be gone
        return ""


def _cuda_version(nv: Any) -> str:
    try:
        v = int(nv.nvmlSystemGetCudaDriverVersion())
        return f"{v // 1000}.{v % 1000 // 10}"
    except Exception:  # noqa: BLE001
        return ""


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class MemorySampler(Sampler):
    """Samples, in a background thread, the GPU memory NVML attributes to a set of processes.

    The figure includes what the PyTorch allocator does not see (CUDA context, cuBLAS/NCCL workspaces).
    Keeps the peak of the largest single process (what counts against a per-process budget) and of the
    sum over all of them. Does nothing, quietly, where NVML is unavailable.
    """

    _thread_name = "autotune-gpu-sampler"

    def __init__(self, pids: Callable[[], Iterable[int]], interval: float = 0.5) -> None:
        super().__init__(pids, interval)
        self.peak_process_bytes: int | None = None
        self.peak_total_bytes: int | None = None

    def _open(self) -> bool:
        # NVML stays initialised while the thread samples: `_close` shuts it down.
        try:
            import pynvml

            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() == 0:
                pynvml.nvmlShutdown()
                return False
        except Exception as exc:  # noqa: BLE001 - no driver: nothing to sample
            log.debug("not sampling GPU memory: %s", exc)
            return False
        return True

    def _close(self) -> None:
        try:
            import pynvml

            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass

    def _sample(self, pids: set[int]) -> None:
        import pynvml

        per_process: dict[int, int] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            for pid, used in _usage(pynvml, pynvml.nvmlDeviceGetHandleByIndex(i)):
                if pid in pids:
                    per_process[pid] = per_process.get(pid, 0) + used
        if per_process:
            self.peak_process_bytes = max(self.peak_process_bytes or 0, max(per_process.values()))
            self.peak_total_bytes = max(self.peak_total_bytes or 0, sum(per_process.values()))


def _usage(nv: Any, handle: object) -> Iterator[tuple[int, int]]:
    """(pid, bytes used) of each process on the GPU behind `handle` whose figure the driver shows."""
    for proc in nv.nvmlDeviceGetComputeRunningProcesses(handle):
        if proc.usedGpuMemory is not None:
            yield int(proc.pid), int(proc.usedGpuMemory)


def process_bytes(cuda_index: int, pid: int) -> int | None:
    """Bytes process `pid` uses on CUDA device `cuda_index` (a child's numbering, per CUDA_VISIBLE_DEVICES), or None
    when unknown: no driver access, or a container that hides process lists.

    Where CUDA_VISIBLE_DEVICES names GPUs by UUID, `cuda_index` is taken as NVML's index.
    """
    index = physical_index(cuda_index)
    try:
        with _session() as nv:
            handle = nv.nvmlDeviceGetHandleByIndex(cuda_index if index is None else index)
            return next((used for p, used in _usage(nv, handle) if p == pid), None)
    except Exception as exc:  # noqa: BLE001 - pynvml raises its own NVMLError family and OSError
        log.debug("pynvml could not report process memory: %s", exc)
    return None


def physical_index(cuda_index: int) -> int | None:
    """NVML's index of CUDA device `cuda_index`, per CUDA_VISIBLE_DEVICES; None where that does not say (a UUID,
    or fewer devices listed)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return cuda_index
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if cuda_index >= len(ids) or not ids[cuda_index].isdigit():
        return None
    return int(ids[cuda_index])


def visible_gpu(cuda_index: int = 0) -> Gpu | None:
    """The GPU that CUDA device `cuda_index` of a child process will be, per CUDA_VISIBLE_DEVICES; no CUDA context made.

    None without NVML, without GPUs, or when CUDA_VISIBLE_DEVICES names GPUs by UUID (then the caller
    falls back to asking torch).
    """
    wanted = physical_index(cuda_index)
    if wanted is None:
        return None
    return next((g for g in driver_facts(with_processes=False).gpus if g.index == wanted), None)
