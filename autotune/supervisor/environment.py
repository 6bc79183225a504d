"""What this machine offers autotune: GPUs and driver, torch and CUDA, bf16, host memory, the plan cache.

`inspect_environment()` gathers the facts for `autotune doctor` without creating a CUDA context (NVML
reads the driver) and without touching the cache file (a read-only SQLite connection). Each fact that
keeps autotune from using a GPU it should use is a *problem* (`autotune doctor` exits 4); a machine with
no NVIDIA driver at all is not a problem: autotune then runs on the CPU under a simulated ceiling.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sqlite3
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil
import torch

from .. import __version__, settings
from ..devices import nvml

_OFF = ("0", "false", "off", "no")


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheHealth:
    path: str
    state: str  # "ok" | "missing" (not created yet) | "off" | "unusable"
    detail: str = ""  # tables and rows when ok, the error when unusable
    size_bytes: int = 0
    filesystem: str = ""  # e.g. "ext4", "nfs4"; "" when unknown


@dataclass(frozen=True, kw_only=True, slots=True)
class Environment:
    versions: dict[str, str]
    driver: nvml.DriverFacts
    torch_cuda_available: bool
    torch_gpu_count: int
    host_total_bytes: int
    host_available_bytes: int
    cpus: int
    cache: CacheHealth
    problems: tuple[str, ...] = field(default_factory=tuple)  # each: what is wrong, and what to do
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def device(self) -> str:
        """Where autotune would run by default: "cuda" or "cpu" (simulated ceiling)."""
        return "cuda" if self.torch_cuda_available else "cpu"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["device"] = self.device
        for gpu in d["driver"]["gpus"]:
            gpu["bf16"] = None if gpu["compute_capability"] is None else tuple(gpu["compute_capability"]) >= (8, 0)
        return d


def inspect_environment() -> Environment:
    """Gather the facts, and judge them."""
    driver = nvml.driver_facts()
    # torch.cuda.is_available() asks the driver for a device count; it creates no context.
    available = torch.cuda.is_available()
    vm = psutil.virtual_memory()
    env = Environment(versions=_versions(), driver=driver, torch_cuda_available=available,
                      torch_gpu_count=torch.cuda.device_count() if available else 0, host_total_bytes=vm.total,
                      host_available_bytes=vm.available, cpus=psutil.cpu_count() or 0, cache=cache_health())
    problems, warnings = _judge(env)
    return Environment(**{**{f: getattr(env, f) for f in env.__dataclass_fields__}, "problems": tuple(problems),
                          "warnings": tuple(warnings)})


def _versions() -> dict[str, str]:
    cudnn = None
    with contextlib.suppress(Exception):
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"autotune": __version__, "python": platform.python_version(), "platform": platform.platform(),
            "torch": torch.__version__, "torch_cuda_build": torch.version.cuda or "none (CPU-only build)",
            "cudnn": str(cudnn) if cudnn else "none", "executable": sys.executable}


def _judge(env: Environment) -> tuple[list[str], list[str]]:
    problems: list[str] = []
    warnings: list[str] = []
    driver = env.driver
    if not driver.ok and not driver.no_driver:
        problems.append(f"an NVIDIA driver is installed but NVML fails ({driver.problem}); check `nvidia-smi`. "
                        "A 'driver/library version mismatch' clears after a reboot or a driver reload.")
    if driver.gpus and not env.torch_cuda_available:
        if torch.version.cuda is None:
            problems.append(f"the driver sees {len(driver.gpus)} GPU(s) but torch {torch.__version__} is a CPU-only "
                            "build; install a CUDA build of torch (https://pytorch.org/get-started/locally/)")
        else:
            problems.append(f"the driver sees {len(driver.gpus)} GPU(s) but torch (CUDA {torch.version.cuda}) cannot "
                            f"use them; the driver supports CUDA {driver.cuda_driver_version or '?'} — install a torch "
                            "built for it, or check CUDA_VISIBLE_DEVICES "
                            f"({os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    if env.torch_cuda_available and any(g.bf16 is False for g in driver.gpus):
        warnings.append("a GPU without bf16 support (compute capability below 8.0): autotune uses fp16 with loss "
                        "scaling there")
    cache = env.cache
    if cache.state == "unusable":
        warnings.append(f"the plan cache is unusable ({cache.detail}); training still works, without it")
    if cache.filesystem and _network(cache.filesystem):
        warnings.append(f"the plan cache is on a network file system ({cache.filesystem}); SQLite does not "
                        "support concurrent writers there. Set AUTOTUNE_CACHE to a local path and share plans "
                        "with `autotune cache export`")
    return problems, warnings


def _network(fstype: str) -> bool:
    try:
        from ..cache.store import is_network_filesystem
    except ImportError:
        return False
    return is_network_filesystem(fstype)


def cache_health(path: str | None = None) -> CacheHealth:
    """The plan cache's path and state, read without writing anything (no file is created)."""
    setting = settings.read(settings.ENV["cache"])
    if path is None and setting.lower() in _OFF and setting:
        return CacheHealth(path="", state="off", detail=f"$AUTOTUNE_CACHE={setting}")
    path = path or _default_cache_path()
    fstype = _filesystem(path)
    if not os.path.exists(path):
        return CacheHealth(path=path, state="missing", detail="not created yet; the first fit creates it",
                           filesystem=fstype)
    size = os.path.getsize(path)
    try:
        detail = _read_only_check(path)
    except sqlite3.Error as exc:
        return CacheHealth(path=path, state="unusable", detail=f"{type(exc).__name__}: {exc}", size_bytes=size,
                           filesystem=fstype)
    state = "ok" if not detail.startswith("integrity:") else "unusable"
    return CacheHealth(path=path, state=state, detail=detail, size_bytes=size, filesystem=fstype)


def _read_only_check(path: str) -> str:
    """`PRAGMA quick_check` and row counts over a read-only connection; raises sqlite3.Error when unreadable."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2.0)
    try:
        check = con.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            return f"integrity: {check}"
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                            "AND name NOT LIKE 'sqlite_%' ORDER BY name")]
        counts = [f"{t}: {con.execute(f'SELECT count(*) FROM [{t}]').fetchone()[0]} rows" for t in tables]
        mode = con.execute("PRAGMA journal_mode").fetchone()[0]
        return f"{', '.join(counts) or 'no tables yet'}; journal {mode}"
    finally:
        con.close()


def _default_cache_path() -> str:
    try:
        from ..cache.store import default_path
    except ImportError:  # the cache module of an older autotune: its documented default
        return os.path.join(os.path.expanduser("~"), ".cache", "autotune", "plans.db")
    return str(default_path())


def _filesystem(path: str) -> str:
    try:
        from ..cache.store import filesystem_type
    except ImportError:
        return ""
    return filesystem_type(path)
