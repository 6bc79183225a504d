"""A child job in a process group of its own: launch, tee its output, watch, stop it, leave nothing behind.

The child is started in a new session (`start_new_session=True`), so its process group id is its pid and
every process it spawns (data-loader workers, say) inherits that group unless it leaves on purpose, as
torchrun's workers do (each gets a session of its own); so every descendant is also recorded by pid
while the job runs. Stopping is always by group and by recorded pid, never by name: SIGTERM (or the
signal the supervisor received) to the group, then SIGKILL to the group and to every descendant seen,
after a grace period. When the leader exits on its own, stragglers still in its group or among its
recorded descendants get the same treatment, so no orphan survives the run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Protocol, TextIO

import psutil

from ..devices.nvml import MemorySampler
from .host_sampler import HostSampler
from .oom_killer import KernelKill, OomKillWatch

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1
TRACK_EVERY_SECONDS = 0.5  # how often the descendant tree is re-read while the child runs
TAIL_BYTES = 64 * 1024  # output kept for classifying a death and for the "traceback tail" passed through


class Started(Protocol):
    """A started job: the parts of `subprocess.Popen` a `Child` uses."""

    pid: int
    returncode: int | None
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class ChildExit:
    """How a child ended."""

    returncode: int  # negative: killed by that signal (subprocess convention)
    seconds: float
    timed_out: bool = False  # killed by us at its deadline
    signal_received: int | None = None  # the supervisor got this signal and forwarded it
    output_tail: str = ""  # last TAIL_BYTES of what the child wrote to the captured stream(s)
    peak_gpu_bytes: int | None = None  # largest single process of the job, per NVML
    peak_gpu_total_bytes: int | None = None  # all processes of the job together, per NVML
    peak_host_bytes: int | None = None  # the job's processes' resident memory together, at its largest
    least_available_bytes: int | None = None  # the machine's available memory at its least while the job ran
    kernel_kill: KernelKill | None = None  # whether the kernel's OOM killer killed it (`oom_killer.py`)


class Child:
    """One launch of a command in its own process group.

    Large: its launch settings (one attribute per argument) and the state of the one running job they
    started: the process, the reader threads and the output's tail, the pids the host sampler tracks, the
    deadline, and how the job ended. The readers, `wait`, `stop` and the signal forwarding all act on that one
    job and its process group, so they stay together.

    Args:
        argv: the command.
        env: its environment.
        echo: copy the captured output to our stderr as it arrives.
        capture_stdout: capture stdout too (merged with stderr); else stdout is inherited, or sent to our
            stderr when `stdout_to_stderr` (so `--json` keeps our stdout for the plan alone).
        timeout: seconds from launch after which the child is stopped (None: no deadline).
        grace: seconds between the polite signal and SIGKILL.
        name: what to call the job in log lines.
        spawn: starts the job instead of `subprocess.Popen`, given its environment (a trial forked by the
            fork server, `forkserver.py`), or returns None and the job starts fresh; used only where the output
            is captured.
        on_line: called with each line the job writes, on stdout and stderr alike (`loss_lines.py`); stdout
            is then read through a pipe too, and passed on where it would have gone.
    """

    def __init__(self, argv: Sequence[str], *, env: dict[str, str], echo: bool = True, capture_stdout: bool = False,
                 stdout_to_stderr: bool = False, timeout: float | None = None, grace: float = 10.0,
                 name: str = "", spawn: Callable[[dict[str, str]], Started | None] | None = None,
                 on_line: Callable[[str], None] | None = None) -> None:
        self.argv = list(argv)
        self.spawn = spawn if capture_stdout else None
        self.name = name or os.path.basename(self.argv[0])
        self.env = env
        self.echo = echo
        self.capture_stdout = capture_stdout
        self.stdout_to_stderr = stdout_to_stderr
        self.timeout = timeout
        self.grace = grace
        self.on_line = on_line
        self.proc: Started | None = None
        self._tail = bytearray()
        self._readers: list[threading.Thread] = []
        self._tracked: dict[int, psutil.Process] = {}
        self._pids: frozenset[int] = frozenset()  # replaced whole, so the sampler thread reads it safely
        self._stop_at: float | None = None
        self._killed = False
        self._timed_out = False
        self._signal: int | None = None
        self._launched = 0.0  # time.monotonic() when start() began: a job's seconds and its deadline count from there
        self._oom_kills: OomKillWatch | None = None

    # -- launching -------------------------------------------------------------------------------------
    def start(self) -> Child:
        self._launched = time.monotonic()
        self._oom_kills = OomKillWatch()
        if self.capture_stdout or self.on_line is not None:
            stdout: int | None = subprocess.PIPE
        elif self.stdout_to_stderr:
            stdout = _stderr_fd()
        else:
            stdout = None
        stderr = subprocess.STDOUT if self.capture_stdout else subprocess.PIPE
        log.debug("launching %s", " ".join(self.argv))
        self.proc = self.spawn(self.env) if self.spawn is not None else None
        env = self.env
        if self.on_line is not None and not self.capture_stdout:
            # A Python job block-buffers a piped stdout: unbuffered, its lines come as printed, as at a terminal.
            env = {"PYTHONUNBUFFERED": "1", **env}
        if self.proc is None:
            self.proc = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                                         stderr=stderr, start_new_session=True)
        self._pids = frozenset({self.proc.pid})
        pipe = self.proc.stdout if self.capture_stdout else self.proc.stderr
        self._read(pipe, _write_stderr if self.echo else None, tail=True)
        if self.on_line is not None and not self.capture_stdout:  # stdout too, passed on where it would have gone
            self._read(self.proc.stdout, _write_stderr if self.stdout_to_stderr else _write_stdout, tail=False)
        return self

    def _read(self, pipe: object, write: Callable[[bytes], None] | None, *, tail: bool) -> None:
        reader = threading.Thread(target=self._tee, args=(pipe, write, tail), name="autotune-tee", daemon=True)
        self._readers.append(reader)
        reader.start()

    def _tee(self, pipe: object, write: Callable[[bytes], None] | None, tail: bool) -> None:
        fd = pipe.fileno()  # type: ignore[attr-defined]
        lines = LineSplitter(self.on_line) if self.on_line is not None else None
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            if tail:
                self._tail += chunk
                del self._tail[:-TAIL_BYTES]
            if write is not None:
                write(chunk)
            if lines is not None:
                lines.feed(chunk)
        if lines is not None:
            lines.feed(b"\n")  # a last line without its newline
        pipe.close()  # type: ignore[attr-defined]

    # -- watching --------------------------------------------------------------------------------------
    def wait(self) -> ChildExit:
        """Wait for the child, enforcing the deadline and the grace period, then clean up its group."""
        assert self.proc is not None, "start() first"
        started = self._launched  # from before the spawn: a fork or an interpreter's start is the job's time too
        sampler = MemorySampler(lambda: self._pids).start()
        host = HostSampler(lambda: {self.proc.pid, *self._pids}).start()  # type: ignore[union-attr]
        tracked_at = 0.0
        try:
            while True:
                try:
                    self.proc.wait(timeout=POLL_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if time.monotonic() - tracked_at >= TRACK_EVERY_SECONDS:
                    self._track()
                    tracked_at = time.monotonic()
                self._enforce(time.monotonic() - started)
            self._clean_leftovers()
        finally:
            sampler.stop()
            host.stop()
        for reader in self._readers:
            reader.join(timeout=5)
        returncode = self.proc.returncode or 0
        kernel = None if self._oom_kills is None else self._oom_kills.ended(
            {self.proc.pid, *self._pids}, sigkilled=returncode == -signal.SIGKILL)
        return ChildExit(returncode=returncode, seconds=time.monotonic() - started,
                         timed_out=self._timed_out, signal_received=self._signal,
                         output_tail=self._tail.decode(errors="replace"),
                         peak_gpu_bytes=sampler.peak_process_bytes, peak_gpu_total_bytes=sampler.peak_total_bytes,
                         peak_host_bytes=host.peak_rss_bytes, least_available_bytes=host.least_available_bytes,
                         kernel_kill=kernel)

    def _enforce(self, elapsed: float) -> None:
        """Stop the job at its deadline; kill it when it outlives the grace period after a stop."""
        if self.timeout is not None and self._stop_at is None and elapsed > self.timeout:
            log.warning("%s: still running after %.0f s; stopping it", self.name, self.timeout)
            self._timed_out = True
            self.stop(signal.SIGTERM)
        if self._stop_at is not None and not self._killed and time.monotonic() - self._stop_at > self.grace:
            log.warning("%s ignored the signal for %.0f s; killing its process group", self.name, self.grace)
            self._kill_all()

    def _track(self) -> None:
        """Remember every descendant seen, so even one that left the group can be killed by pid later."""
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):  # type: ignore[union-attr]
                self._tracked.setdefault(p.pid, p)
        except psutil.Error:
            return
        self._pids = frozenset({self.proc.pid, *self._tracked})  # type: ignore[union-attr]

    # -- stopping --------------------------------------------------------------------------------------
    def forward(self, signum: int) -> None:
        """A signal the supervisor received: pass it to the job's group; a second one kills at once."""
        self._signal = self._signal or signum
        if self._stop_at is None:
            self.stop(signum)
        else:
            self._kill_all()

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Send `signum` to the group; `wait` sends SIGKILL if the job is still there after the grace period."""
        if self.proc is None or self._stop_at is not None:
            return
        self._track()
        self._stop_at = time.monotonic()
        _signal_group(self.proc.pid, signum)

    def _kill_all(self) -> None:
        self._killed = True
        _signal_group(self.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        for p in self._tracked.values():
            with contextlib.suppress(psutil.Error):
                p.kill()  # psutil checks the pid still names the process it saw, so no reused pid is hit

    def _clean_leftovers(self) -> None:
        """The leader is gone; stop whatever it left behind in its group or among its descendants."""
        leftovers = [p for p in self._tracked.values() if _alive(p)] + _group_members(self.proc.pid)  # type: ignore[union-attr]
        leftovers = list({p.pid: p for p in leftovers}.values())
        if not leftovers:
            return
        log.info("stopping %d process(es) the job left behind: %s", len(leftovers),
                 ", ".join(str(p.pid) for p in leftovers))
        for p in leftovers:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(leftovers, timeout=0 if self._killed else self.grace)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=5)


class LineSplitter:
    """Cuts a stream's chunks into lines for `on_line`; a carriage return ends a line too (progress bars
    redraw with one), and a line longer than `TAIL_BYTES` is cut there. An error in `on_line` is logged once
    and the stream goes on: watching the output never breaks passing it on."""

    def __init__(self, on_line: Callable[[str], None]) -> None:
        self.on_line = on_line
        self._partial = b""
        self._failed = False

    def feed(self, chunk: bytes) -> None:
        *lines, self._partial = re.split(rb"\r\n|\r|\n", self._partial + chunk)
        if len(self._partial) > TAIL_BYTES:
            lines.append(self._partial)
            self._partial = b""
        for line in lines:
            if line and not self._failed:
                try:
                    self.on_line(line.decode(errors="replace"))
                except Exception:  # a watcher's fault must not stop the job's output
                    self._failed = True
                    log.exception("reading the job's output lines failed; its output still passes through")


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _group_members(pgid: int) -> list[psutil.Process]:
    """Live processes whose process group is `pgid` (a group id is never reused while it has members)."""
    members = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if p.pid != os.getpid() and os.getpgid(p.pid) == pgid and _alive(p):
                members.append(p)
    return members


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return 2


def _write_stdout(chunk: bytes) -> None:
    _write(sys.stdout, chunk)


def _write_stderr(chunk: bytes) -> None:
    _write(sys.stderr, chunk)


def _write(stream: TextIO, chunk: bytes) -> None:
    try:
        buffer = getattr(stream, "buffer", None)
        if buffer is not None:
            buffer.write(chunk)
        else:
            stream.write(chunk.decode(errors="replace"))
        stream.flush()
    except (OSError, ValueError):  # our stream closed: keep draining the child's pipe regardless
        pass


class SignalForwarder:
    """While active, SIGINT and SIGTERM to the supervisor are forwarded to the running child's group.

    `received` keeps the first signal, so the supervisor stops launching and exits 128 + signal.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.child: Child | None = None
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: object) -> None:
        self.received = self.received or signum
        if self.child is not None:
            self.child.forward(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[SignalForwarder]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signal handlers can only be set from the main thread (e.g. under a test runner)
            return
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        try:
            yield self
        finally:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)  # type: ignore[arg-type]

    def run(self, child: Child) -> ChildExit:
        """Start `child`, wait for it with signals forwarded to it, and return how it ended."""
        self.child = child.start()
        try:
            if self.received is not None:  # a signal arrived between two children
                child.forward(self.received)
            return child.wait()
        finally:
            self.child = None
