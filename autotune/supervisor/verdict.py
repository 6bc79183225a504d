"""Why a job ended: ok, out of memory, another failure, timed out, or interrupted.

The agent's record (written while the exception object still existed, classified with `is_oom`) is
trusted first; the job's output is read with `is_oom_text` only where no record says otherwise (the
job died before the agent could write, or a launcher such as torchrun failed around it). A SIGKILL that
left no record is an OOM only with evidence: the kernel's OOM killer acted (`oom_killer.py`), or the
sampled host memory was near exhausted when the job died. Without it the kill came from elsewhere (a
person, a scheduler): the verdict is an error with exit 137, which is passed through, not restarted, and
not recorded against the plan. Anything else is not an OOM and is never retried as one.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass, field
from typing import Any

import psutil

from ..errors import is_host_oom_kill, is_oom_text
from ..plan import Plan
from ..sizes import format_bytes, shorten
from .process import ChildExit

log = logging.getLogger(__name__)

KINDS = ("ok", "oom", "error", "timeout", "interrupted")


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    kind: str  # one of KINDS
    note: str  # one line: the error, or what happened
    exit_code: int  # what `autotune run` exits with if this ends the run
    exit: ChildExit
    records: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    host_memory: bool = False  # killed by SIGKILL with no result while host memory was near exhausted

    @property
    def autotune_error(self) -> str | None:
        """The message of an error autotune raised on purpose in the job (NoFeasiblePlan...), if one ended it."""
        for record in self.records:
            error = record.get("autotune_error")
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                return error["message"]
        return None

    @property
    def plan(self) -> Plan | None:
        """The plan `fit` reported in this job (rank 0's), if any."""
        for record in self.records:
            if isinstance(record.get("plan"), dict):
                try:
                    return Plan.from_dict(record["plan"])
                except (ValueError, TypeError) as exc:
                    log.warning("ignoring an invalid plan in the job's result file: %s", exc)
        return None


def classify(exit_: ChildExit, records: list[dict[str, Any]], host_budget: int | None = None) -> Verdict:
    """Decide why the job ended from its exit, its result records (one per rank) and its output tail.

    `host_budget`: the run's `--host-budget` in bytes, against which the job's sampled memory is judged."""
    records_t = tuple(records)

    def verdict(kind: str, note: str, code: int, host: bool = False) -> Verdict:
        return Verdict(kind=kind, note=note, exit_code=code, exit=exit_, records=records_t, host_memory=host)

    if exit_.signal_received is not None:
        name = signal.Signals(exit_.signal_received).name
        return verdict("interrupted", f"interrupted by {name}", 128 + exit_.signal_received)
    if exit_.timed_out:
        return verdict("timeout", f"still running after {exit_.seconds:.0f} s, stopped", 124)
    if exit_.returncode == 0:
        return verdict("ok", "", 0)
    code = shell_code(exit_.returncode)
    # fit's own errors map to autotune run's exit codes whatever a launcher (torchrun) made of the rank's exit.
    mapped = [r for r in records if isinstance(r.get("autotune_error"), dict) and r.get("exit_code") in (2, 3, 4)]
    if mapped:
        return verdict("error", str(mapped[0].get("error", "")), int(mapped[0]["exit_code"]))
    ooms = [r for r in records if r.get("outcome") == "oom"]
    if ooms:
        return verdict("oom", str(ooms[0].get("error", "out of memory")), code)
    # An exception the agent saw and judged not to be an OOM outranks any OOM text in the output
    # (a script may log a recovered OOM long before failing for another reason).
    judged = [r for r in records if r.get("outcome") == "error" and r.get("error")]
    if judged:
        return verdict("error", str(judged[0]["error"]), code)
    line = _oom_line(exit_.output_tail)
    if line is not None:
        return verdict("oom", line, code)
    if is_host_oom_kill(exit_.returncode, wrote_result=any("outcome" in r for r in records)):
        if host_exhausted(exit_, host_budget):
            return verdict("oom", f"killed by SIGKILL while host memory was near exhausted (the job reached "
                                  f"{format_bytes(exit_.peak_host_bytes or 0)} resident, "
                                  f"{format_bytes(exit_.least_available_bytes or 0)} available at the least)",
                           code, host=True)
        kernel = exit_.kernel_kill
        if kernel is not None and kernel.killed:
            return verdict("oom", f"killed by the kernel's OOM killer ({kernel.evidence})", code)
        return verdict("error", _not_memory(exit_), code)
    return verdict("error", f"exited with code {code}", code)


def _not_memory(exit_: ChildExit) -> str:
    """The note on a SIGKILL with no sign of memory running out: what the kernel said, and the host's room."""
    kernel = exit_.kernel_kill
    said = [kernel.evidence] if kernel is not None and kernel.evidence else []
    if exit_.least_available_bytes is not None:
        said.append(f"host memory never below {format_bytes(exit_.least_available_bytes)} available")
    return "killed by SIGKILL with no sign of running out of memory" + (f" ({'; '.join(said)})" if said else "")


NEAR_EXHAUSTED = 0.9  # of the host budget the job reached, or of the machine's memory gone, to call it exhausted


def host_exhausted(exit_: ChildExit, host_budget: int | None) -> bool:
    """Whether the job's sampled memory says host memory ran out: it reached `NEAR_EXHAUSTED` of the host budget,
    or the machine's available memory fell under 1 - `NEAR_EXHAUSTED` of its total."""
    if exit_.peak_host_bytes and host_budget and exit_.peak_host_bytes >= NEAR_EXHAUSTED * host_budget:
        return True
    total = psutil.virtual_memory().total
    least = exit_.least_available_bytes
    return least is not None and least < (1 - NEAR_EXHAUSTED) * total


def shell_code(returncode: int) -> int:
    """A child's return code as a shell reports it: killed by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _oom_line(text: str) -> str | None:
    if not is_oom_text(text):
        return None
    for line in reversed(text.splitlines()):
        if is_oom_text(line):
            return shorten(line.strip(), 300)
    return "out of memory (per the job's output)"
