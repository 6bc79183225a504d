"""The job's host memory while it runs: its processes' resident memory together and the machine's available memory."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import psutil

from ..devices import host as host_memory


class HostSampler:
    """Samples, in a background thread, the job's resident memory (its processes together) and the machine's
    available memory: what tells a job the kernel killed for host memory from one killed for another reason."""

    def __init__(self, pids: Callable[[], Iterable[int]], interval: float = 0.2) -> None:
        self._pids = pids
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak_rss_bytes: int | None = None
        self.least_available_bytes: int | None = None

    def start(self) -> HostSampler:
        self._thread = threading.Thread(target=self._loop, name="autotune-host-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self._interval)

    def _sample(self) -> None:
        rss = 0
        for pid in set(self._pids()):
            try:
                rss += psutil.Process(pid).memory_info().rss
            except psutil.Error:
                continue  # gone between the listing and the reading
        available = host_memory.available_bytes()
        self.peak_rss_bytes = max(self.peak_rss_bytes or 0, rss)
        self.least_available_bytes = min(self.least_available_bytes or available, available)

