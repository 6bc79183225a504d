"""The plan cache under `autotune run`: a job restarted after OOMs keeps its cache, and no write is lost.

SQLite's locks are POSIX record locks, which a process drops on every descriptor of a file when it closes any
one of them; these tests run the real supervisor (inside the test's process, through click's test runner), real
jobs and real SQLite connections in other processes.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
from cache_samples import sample
from click.testing import CliRunner

from autotune.cache.store import PlanCache
from autotune.cache.trouble import check_integrity
from autotune.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
TIMEOUT = 300  # seconds for the whole `autotune run`: four launches of a torch job on two shared cores


def rows_seen_elsewhere(path: Path) -> tuple[set[str], int]:
    """(plan keys, failure count) as a fresh process reads them: what the next job would find."""
    code = ("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
            "print(*(k for (k,) in c.execute('SELECT key FROM plans'))); "
            "print(c.execute('SELECT count(*) FROM failures').fetchone()[0]); c.close()")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    keys, failures = out.stdout.splitlines()
    return set(keys.split()), int(failures)


def open_here(path: Path) -> list[str]:
    """The descriptors this process holds on the cache file and its -wal / -shm."""
    return [f.path for f in psutil.Process().open_files() if f.path.startswith(str(path))]


@pytest.mark.slow  # `autotune run` and four launches of a torch job
def test_a_cooperative_job_restarted_after_three_ooms_keeps_its_cache(tmp_path: Path,
                                                                     capfd: pytest.CaptureFixture[str]) -> None:
    path, log = tmp_path / "plans.db", tmp_path / "launches"
    # One thread per job; the script's step costs a fixed 10 ms, so the first plan takes the largest micro-batch
    # and each restart's plan a smaller one but not 1 (after an OOM at 1 there is nothing to restart with).
    env = {"AUTOTUNE_CACHE": str(path), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # The supervisor runs in this process (a subprocess would import torch once more); a SIGTERM after TIMEOUT
    # is forwarded to its job and ends the run (exit 143), so a hung job fails the test instead of holding it.
    deadline = threading.Timer(TIMEOUT, os.kill, (os.getpid(), signal.SIGTERM))
    deadline.start()
    try:
        done = CliRunner().invoke(main, ["run", "--global-batch-size", "16", "--budget", "256MiB", "--trial-steps", "3",
                                         "--max-restarts", "3", str(SCRIPTS / "cooperative_ooms.py"), str(log), "3"],
                                  env=env, catch_exceptions=False)
    finally:
        deadline.cancel()
    stderr = done.stderr + capfd.readouterr().err  # and what reached descriptor 2 directly, as a subprocess's would

    assert done.exit_code == 0, stderr
    assert "CacheWarning" not in stderr and "corrupt" not in stderr, stderr
    launches = [line.split() for line in log.read_text().splitlines()]
    assert [int(n) for n, *_ in launches] == [0, 1, 2, 3]
    micro = [int(m) for _, m, *_ in launches]
    assert all(after < before for before, after in zip(micro, micro[1:])), micro  # each OOM lowered the cap
    # Every job, and the file at the end, saw one file: never moved aside and started again.
    assert {int(inode) for _, _, _, inode, _ in launches} == {path.stat().st_ino}
    assert not list(tmp_path.glob("plans.db.corrupt-*"))
    keys, failures = rows_seen_elsewhere(path)
    assert {key for _, _, key, _, _ in launches} <= keys  # each launch's plan
    assert failures == 3  # each OOM, recorded by the supervisor
    with PlanCache(path) as cache:
        final = cache.get(launches[-1][2])
    assert final is not None and final.measured_samples_per_second is not None  # the supervisor's run record
    # By the last launch the supervisor had recorded three OOMs, through one connection.
    assert int(launches[-1][4]) <= 1
    assert check_integrity(path, timeout=10).damaged is False


def test_a_second_cache_opened_in_one_process_loses_no_write_of_the_first(tmp_path: Path) -> None:
    path = tmp_path / "plans.db"
    first = PlanCache(path)
    first.put(*sample(0))
    second = PlanCache(path)  # opening must not touch the file under the first's connection
    # Another process comes and goes; while this process holds the file open, its close must not
    # checkpoint and delete the WAL that this process's connections still write to.
    assert rows_seen_elsewhere(path)[0] == {sample(0)[0].key}
    first.put(*sample(1))
    second.put(*sample(2))
    try:
        assert rows_seen_elsewhere(path)[0] == {sample(i)[0].key for i in range(3)}
    finally:
        first.close()
        second.close()
    assert open_here(path) == []


def test_corrupt_is_what_sqlites_integrity_check_says(tmp_path: Path) -> None:
    path = tmp_path / "plans.db"
    with PlanCache(path) as cache:
        for i in range(20):
            cache.put(*sample(i))
        # Sound while a connection of this process holds it and another process writes to it.
        writer = sqlite3.connect(path, isolation_level=None)
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("INSERT INTO failures (key, micro_batch_size, time) VALUES ('x', 1, 0)")
        try:
            assert check_integrity(path, timeout=10).damaged is False
        finally:
            writer.rollback()
            writer.close()
    data = bytearray(path.read_bytes())
    data[4096:] = b"\xa5" * (len(data) - 4096)  # page 1 intact, every table page damaged
    path.write_bytes(bytes(data))
    verdict = check_integrity(path, timeout=10)
    assert verdict.damaged and "integrity_check" in verdict.detail
