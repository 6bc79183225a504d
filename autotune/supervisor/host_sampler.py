"""The job's host memory while it runs: its processes' resident memory together and the machine's available memory."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import psutil

from ..devices import host as host_memory
from ..devices.sampler import Sampler


class HostSampler(Sampler):
    """Samples, in a background thread, the job's resident memory (its processes together) and the machine's
    available memory: what tells a job the kernel killed for host memory from one killed for another reason."""

    _thread_name = "autotune-host-sampler"

    def __init__(self, pids: Callable[[], Iterable[int]], interval: float = 0.2) -> None:
        super().__init__(pids, interval)
        self.peak_rss_bytes: int | None = None
        self.least_available_bytes: int | None = None

    def _sample(self, pids: set[int]) -> None:
        rss = 0
        for pid in pids:
            try:
                rss += psutil.Process(pid).memory_info().rss
            except psutil.Error:
                continue  # gone between the listing and the reading
        available = host_memory.available_bytes()
        self.peak_rss_bytes = max(self.peak_rss_bytes or 0, rss)
        self.least_available_bytes = min(self.least_available_bytes or available, available)
