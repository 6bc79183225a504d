"""A background thread that samples a job's processes at an interval, between `start()` and `stop()`."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TypeVar

log = logging.getLogger(__name__)

_S = TypeVar("_S", bound="Sampler")


class Sampler(ABC):
    """Calls `_sample` with the current set of process ids every `interval` seconds, in a daemon thread.

    `pids()` is called at every sample so a job's process tree can grow (torchrun workers, data loaders).
    A subclass says what one sample reads (`_sample`), and may claim and let go of what sampling needs
    (`_open`, `_close`); where `_open` finds nothing to sample, no thread starts and `stop()` does nothing.
    """

    _thread_name = "autotune-sampler"

    def __init__(self, pids: Callable[[], Iterable[int]], interval: float) -> None:
        self._pids = pids
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self: _S) -> _S:
        if self._open():
            self._thread = threading.Thread(target=self._loop, name=self._thread_name, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._thread = None
        self._close()

    def _open(self) -> bool:
        """Claim what sampling needs; False where there is nothing to sample."""
        return True

    def _close(self) -> None:
        """Let go of what `_open` claimed (called once the thread has stopped)."""
        return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sample(set(self._pids()))
            except Exception as exc:  # noqa: BLE001 - a sample lost is not worth failing the job for
                log.debug("%s: a sample failed: %s", self._thread_name, exc)
            self._stop.wait(self._interval)

    @abstractmethod
    def _sample(self, pids: set[int]) -> None:
        """Read one sample of the processes `pids` and fold it into the figures kept."""
