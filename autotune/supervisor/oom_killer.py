"""Whether the kernel's OOM killer killed a job: the evidence that a SIGKILL was about memory.

A job that dies of SIGKILL may have been killed by the kernel for host memory, or by anything else (a
person's `kill -9`, a scheduler's preemption, a watchdog). Only the first is an out-of-memory failure to
restart after and record against the plan. The kernel says which in two places:

- the memory cgroup's OOM-kill count (cgroup v2 `memory.events`, v1 `memory.oom_control`, line `oom_kill`),
  read before the job starts and after it ends: it rises with every process of the cgroup the kernel kills
  for memory, whether the cgroup's limit or the whole machine ran out. The job runs in the supervisor's
  cgroup (a child inherits it), so the supervisor's own cgroup is the one read;
- the kernel log (/dev/kmsg, where readable), whose "Killed process PID" lines name each victim. Read only
  where no cgroup count can be, since it needs privileges most users lack.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
KERNEL_LOG = "/dev/kmsg"
_VICTIM = re.compile(r"Killed process (\d+)")


def cgroup_counter() -> Path | None:
    """The file holding this process's memory cgroup OOM-kill count, or None where there is none to read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # "hierarchy-id:controllers:path"; v2 is "0::path", a v1 memory hierarchy "N:memory:path"
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            candidates = [CGROUP_ROOT / path.lstrip("/") / "memory.events", CGROUP_ROOT / "memory.events"]
        elif "memory" in controllers.split(","):
            base = CGROUP_ROOT / controllers
            candidates = [base / path.lstrip("/") / "memory.oom_control", base / "memory.oom_control"]
        else:
            continue
        # Inside a cgroup namespace the path can name the host's view; the mount's root is then ours.
        for candidate in candidates:
            if read_count(candidate) is not None:
                return candidate
    return None


def read_count(path: Path | None) -> int | None:
    """The `oom_kill` count in `path` (a `memory.events` or `memory.oom_control` file); None if unreadable."""
    if path is None:
        return None
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelKill:
    """What the kernel says about a job's death."""

    killed: bool | None  # its OOM killer killed a process of the job; None where the kernel's record cannot be read
    evidence: str  # how that is known, as a clause for the job's verdict


class OomKillWatch:
    """Watches one job: the cgroup's OOM-kill count at its start, compared with the count at its end."""

    def __init__(self) -> None:
        self.path = cgroup_counter()
        self.before = read_count(self.path)

    def rose(self) -> int | None:
        """How many processes the kernel killed for memory in the cgroup since the start; None where unknown."""
        after = read_count(self.path)
        return None if after is None or self.before is None else max(0, after - self.before)

    def ended(self, pids: Iterable[int], sigkilled: bool) -> KernelKill:
        """What the kernel says about the job that just ended, whose processes were `pids`. The kernel log is
        read only for a job that died of SIGKILL, and only where the cgroup's count cannot be."""
        rose = self.rose()
        if rose is not None:
            return KernelKill(killed=rose > 0, evidence=(
                f"the memory cgroup's oom_kill count rose by {rose} while it ran" if rose else
                "the memory cgroup's oom_kill count did not rise while it ran"))
        if not sigkilled:
            return KernelKill(killed=None, evidence="")
        found = killed_in_kernel_log(pids)
        if found is not None:
            return KernelKill(killed=found, evidence="the kernel log names it as the OOM killer's victim" if found
                              else "the kernel log names none of its processes as the OOM killer's victim")
        return KernelKill(killed=None, evidence="neither a memory cgroup's oom_kill count nor the kernel log can be "
                                                "read here")


def killed_in_kernel_log(pids: Iterable[int]) -> bool | None:
    """Whether the kernel log names one of `pids` as an OOM-killer victim; None where the log cannot be read."""
    wanted = {str(p) for p in pids}
    try:
        fd = os.open(KERNEL_LOG, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found = False
    try:
        while True:
            try:
                record = os.read(fd, 8192)  # one record per read: "prio,seq,time,flags;message"
            except BlockingIOError:
                break  # the end of the log
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # a record overwritten while we read: go on with the next
                return None
            if not record:
                break
            match = _VICTIM.search(record.decode(errors="replace"))
            found = found or (match is not None and match.group(1) in wanted)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    return found
