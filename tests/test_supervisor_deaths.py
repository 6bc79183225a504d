"""How `autotune run` tells a job's deaths apart: an OOM (restarted, recorded against the job's own plan) from a
kill that memory does not explain (passed through as exit 137, nothing recorded).

The runs are real: `autotune run` (inside the test's process, through click's test runner) supervises real
scripts in tests/scripts/, in processes of their own, that kill themselves or raise the OOM a GPU would, and the
plan cache is a real SQLite file read back as the next job would read it.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from autotune.cli.main import main
from autotune.supervisor.oom_killer import KernelKill, OomKillWatch, read_count
from autotune.supervisor.process import ChildExit
from autotune.supervisor.verdict import classify

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
TIMEOUT = 240  # seconds for one `autotune run`: a few launches of a tiny torch job on two shared cores


RunHere = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def autotune_run(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> RunHere:
    """`autotune run` of a tiny job with the plan cache in `tmp_path`, inside this process, with the exit code and
    output a subprocess would give: what the command writes through click, plus what its jobs write to the
    descriptors they inherit (read by capfd). Not a subprocess of its own: that would import torch once more."""
    env = {"AUTOTUNE_CACHE": str(tmp_path / "plans.db"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def invoke(*args: str) -> subprocess.CompletedProcess[str]:
        command = ["run", "--global-batch-size", "16", "--budget", "256MiB", "--trial-steps", "3", *args]
        capfd.readouterr()
        # The run forwards a SIGTERM to its job and exits 143, so a hung job fails the test instead of holding it.
        deadline = threading.Timer(TIMEOUT, os.kill, (os.getpid(), signal.SIGTERM))
        deadline.start()
        try:
            result = CliRunner().invoke(main, command, env=env, catch_exceptions=False)
        finally:
            deadline.cancel()
        inherited = capfd.readouterr()
        return subprocess.CompletedProcess(["autotune", *command], result.exit_code,
                                          result.stdout + inherited.out, result.stderr + inherited.err)

    return invoke


def failures(tmp_path: Path) -> list[tuple[str, int]]:
    """(plan key, micro-batch) of every OOM stored in the cache, oldest first."""
    with sqlite3.connect(tmp_path / "plans.db") as db:
        return [(k, m) for k, m in db.execute("SELECT key, micro_batch_size FROM failures ORDER BY rowid")]


def launches(log: Path) -> list[tuple[int, int]]:
    """(restart count, micro-batch) of each launch, as the script logged them."""
    return [(int(n), int(m)) for n, m, *_ in (line.split() for line in log.read_text().splitlines())]


# -- a SIGKILL ----------------------------------------------------------------------------------------

@pytest.mark.slow  # a torch job in a process of its own, whose fit tunes
def test_a_sigkill_with_no_memory_pressure_is_passed_through_as_137_and_recorded_nowhere(
        tmp_path: Path, autotune_run: RunHere) -> None:
    log = tmp_path / "launches"
    done = autotune_run("--max-restarts", "2", str(SCRIPTS / "killed_after_fit.py"), str(log))

    assert done.returncode == 128 + signal.SIGKILL, done.stderr
    assert [n for n, _ in launches(log)] == [0]  # never restarted
    assert failures(tmp_path) == []  # nothing against the plan: the next launch (or a teammate) is not capped
    told = [line for line in done.stderr.splitlines() if "killed by SIGKILL" in line]
    assert len(told) == 1 and "no sign of running out of memory" in told[0], done.stderr
    assert "not restarted" in told[0] and "nothing recorded against the plan" in told[0]
    assert "out of memory after" not in done.stderr and "Traceback" not in done.stderr


def _killed(**kw: object) -> ChildExit:
    return ChildExit(returncode=-signal.SIGKILL, seconds=1.0, least_available_bytes=20 * 2**30, **kw)  # type: ignore[arg-type]


def test_a_sigkill_is_an_oom_only_with_the_kernels_or_the_hosts_evidence() -> None:
    kernel = KernelKill(killed=True, evidence="the memory cgroup's oom_kill count rose by 1 while it ran")
    by_kernel = classify(_killed(kernel_kill=kernel), [])
    assert (by_kernel.kind, by_kernel.exit_code) == ("oom", 137)
    assert by_kernel.note == f"killed by the kernel's OOM killer ({kernel.evidence})"

    # The job reached 95% of its host budget: host memory ran out, whatever the kernel's count says.
    hog = classify(_killed(peak_host_bytes=950 * 2**20), [], host_budget=1000 * 2**20)
    assert (hog.kind, hog.host_memory) == ("oom", True)

    for said in (KernelKill(killed=False, evidence="the memory cgroup's oom_kill count did not rise while it ran"),
                 KernelKill(killed=None, evidence="neither a memory cgroup's oom_kill count nor the kernel log can "
                                                  "be read here"), None):
        other = classify(_killed(kernel_kill=said), [{"plan": None}])
        assert (other.kind, other.exit_code, other.host_memory) == ("error", 137, False)
        assert other.note.startswith("killed by SIGKILL with no sign of running out of memory")
        assert "20.00 GiB available" in other.note

    # The job's own OOM report outranks how it died.
    reported = classify(_killed(), [{"outcome": "oom", "error": "OutOfMemoryError: CUDA out of memory"}])
    assert reported.kind == "oom"


def test_the_oom_kill_count_is_read_from_either_cgroup_version(tmp_path: Path) -> None:
    v2 = tmp_path / "memory.events"
    v2.write_text("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n")
    v1 = tmp_path / "memory.oom_control"
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n")
    assert (read_count(v2), read_count(v1), read_count(tmp_path / "absent")) == (2, 7, None)

    watch = OomKillWatch()  # this machine's own cgroup, where it has one
    if watch.path is None:
        pytest.skip("no memory cgroup's oom_kill count is readable here")
    assert watch.rose() == 0  # nothing was killed for memory since the line above


# -- a restart's OOM ----------------------------------------------------------------------------------

@pytest.mark.slow  # two `autotune run`s, three launches of a torch job
def test_a_restarts_oom_is_recorded_against_the_jobs_own_key_so_the_next_launch_starts_below_it(
        tmp_path: Path, autotune_run: RunHere) -> None:
    log = tmp_path / "launches"
    script = str(SCRIPTS / "cooperative_oom_above.py")
    first = autotune_run("--max-restarts", "1", script, str(log), "1")  # every micro-batch above 1 fails
    assert first.returncode == 3, first.stderr
    (_, micro0, key), (_, micro1, capped) = (line.split() for line in log.read_text().splitlines())
    assert capped != key  # the restart ran under a micro-batch cap, which is part of its key
    # Both OOMs stand against the job's own key, the one a launch without the supervisor's cap computes.
    assert failures(tmp_path) == [(key, int(micro0)), (key, int(micro1))]

    log.unlink()
    again = autotune_run("--max-restarts", "0", script, str(log), "1")
    [(_, micro, key_again)] = (line.split() for line in log.read_text().splitlines())
    assert key_again == key and int(micro) < min(int(micro0), int(micro1)), again.stderr
