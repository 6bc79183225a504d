"""The fault table (README "Faults"): each scenario driven through the real thing.

Real SQLite files, real processes and signals, the real `autotune.fit` on a tiny GPT under the simulated
ceiling, the CLI through click's runner (`autotune run` too: its jobs are real processes). Each test names the
fault it covers; the README's table lists them.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tracemalloc
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cli_here
import pytest
import torch
from cache_samples import cache_warnings, clean_environment, fit, sample, tiny_workload  # noqa: F401 - autouse fixture
from cli_here import RunHere
from click.testing import CliRunner

from autotune.cache.lines import read_rows
from autotune.cache.rows import MAX_LINE_BYTES
from autotune.cache.store import PlanCache
from autotune.cli.main import main


def cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


NESTED = b"[" * 10_000 + b"]" * 10_000  # deeper than Python's recursion limit
NOT_UTF8 = b'{"schema": 1, "key": "\xff\xfe"}'


def valid_line(i: int) -> bytes:
    plan, parts = sample(i)
    from autotune.cache.rows import PlanRow

    return PlanRow(key=plan.key, parts=parts, plan=plan, updated=1.0).to_json().encode()


# -- rows from elsewhere ----------------------------------------------------------------------------------------------

def test_a_deeply_nested_team_line_neither_stops_fit_nor_hides_the_teams_plans(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch = tiny_workload()
    alice = PlanCache(tmp_path / "alice.db")
    tuned = fit(model, batch, alice, max_trials=2)  # any plan of Alice's will do: the team line is what is tested
    team = tmp_path / "team"
    team.mkdir()
    alice.export(team / "alice.jsonl")
    (team / "mallory.jsonl").write_bytes(NESTED + b"\n" + NOT_UTF8 + b"\n")
    monkeypatch.setenv("AUTOTUNE_TEAM_DIR", str(team))
    with cache_warnings() as caught:
        hit = fit(model, batch, tmp_path / "mine.db")
    assert hit.source == "cache"
    # Alice's plan, served once one trial of it fitted here (a teammate's plan is a claim until then).
    assert hit.trials[:-1] == tuned.trials and hit.findings == (*tuned.findings, hit.findings[-1])
    assert hit.findings[-1].kind == "verified"
    assert hit.findings[-1].figures == {"peak_bytes": hit.trials[-1].peak_bytes,
                                        "samples_per_second": hit.trials[-1].samples_per_second}
    assert hit.samples_per_second == hit.trials[-1].samples_per_second  # measured here, not Alice's figure
    assert hit.with_evidence(findings=tuned.findings, trials=tuned.trials, peak_memory_bytes=tuned.peak_memory_bytes,
                             samples_per_second=tuned.samples_per_second, tokens_per_second=tuned.tokens_per_second,
                             mfu=tuned.mfu).with_provenance(source="tuned") == tuned
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "mallory.jsonl" in str(caught[0].message) and "nested deeper" in str(caught[0].message)


def test_cache_import_rejects_bad_lines_by_number_and_stores_the_valid_rows(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle.jsonl"
    bundle.write_bytes(b"\n".join([NESTED, NOT_UTF8, valid_line(0), b"1e999", valid_line(1)]) + b"\n")
    result = cli("cache", "--cache", str(tmp_path / "plans.db"), "import", str(bundle))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "rejected line 1: JSON nested deeper than the 32 levels" in result.output
    assert "rejected line 2: not UTF-8 (invalid byte 0xff" in result.output
    assert "rejected line 4: 1e999 is not a number" in result.output
    assert "imported 2 plan(s)" in result.output
    assert {e.key for e in PlanCache(tmp_path / "plans.db").entries()} == {sample(0)[0].key, sample(1)[0].key}


def test_an_over_long_line_is_rejected_without_being_held_in_memory(tmp_path: Path) -> None:
    bundle = tmp_path / "huge.jsonl"
    size = 12 * MAX_LINE_BYTES
    with open(bundle, "wb") as f:
        f.write(b'{"x": "')
        for _ in range(size // 2**20):
            f.write(b"a" * 2**20)
        f.write(b'"}\n' + valid_line(0) + b"\n")
    tracemalloc.start()
    try:
        results = list(read_rows(bundle))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [(n, row is None) for n, row, _ in results] == [(1, True), (2, False)]
    assert "over the" in results[0][2]
    assert peak < 3 * MAX_LINE_BYTES, f"reading a {size:,}-byte line held {peak:,} bytes"


def test_cache_show_escapes_terminal_control_characters(tmp_path: Path) -> None:
    plan, parts = sample(0)
    evil = "\x1b]0;owned\x07\x1b[2J\u202egnp.exe"
    store = PlanCache(tmp_path / "plans.db")
    store.put(plan.with_evidence(reason=evil), parts)
    store.mark_unsafe(plan.key, micro_batch_size=4, note="\x1b[31mred")
    shown = cli("cache", "--cache", str(tmp_path / "plans.db"), "show", plan.key[:8]).output
    listed = cli("cache", "--cache", str(tmp_path / "plans.db"), "list").output
    for text in (shown, listed):
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert "\\x1b]0;owned\\x07\\x1b[2J\\u202egnp.exe" in shown and "\\x1b[31mred" in shown
    assert json.loads(cli("cache", "--cache", str(tmp_path / "plans.db"), "show", "--json",
                          plan.key[:8]).output)["plan"]["evidence"]["reason"] == evil


# -- autotune run: exit codes as promised -----------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
RUN_TIMEOUT = 240  # seconds for one `autotune run` (two busy CPUs start torch slowly)


@pytest.fixture
def autotune_run(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> RunHere:
    """`autotune run ARGS...` in this process (`cli_here`), with this test's cache."""
    env = {"AUTOTUNE_CACHE": str(tmp_path / "plans.db"), "PYTHONUNBUFFERED": "1"}
    return lambda *args: cli_here.run_here(capfd, args, env=env, timeout=RUN_TIMEOUT)


def launches(log: Path) -> list[str]:
    return sorted(line for p in log.parent.glob(log.name + ".*") for line in p.read_text().splitlines())


def assert_autotune_error(done: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert done.returncode == code, done.stderr
    assert f"autotune: error: {text}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "not retried" not in done.stderr, done.stderr


@pytest.mark.slow  # two `autotune run`s of a torch job
def test_cooperative_nothing_fits_exits_3_with_autotunes_message(tmp_path: Path, autotune_run: RunHere) -> None:
    log = tmp_path / "launches"
    done = autotune_run("--budget", "1MiB", "--device", "cpu", "--trial-steps", "1",
                        str(SCRIPTS / "cooperative_fit.py"), str(log), "--width", "512")
    assert_autotune_error(done, 3, "no configuration fits")
    assert launches(log) == ["launch 0 1"], "nothing fits is not an OOM to restart after"


@pytest.mark.slow  # its job imports torch in a process of its own
def test_cooperative_invalid_setting_inside_the_job_exits_2(tmp_path: Path, autotune_run: RunHere) -> None:
    log = tmp_path / "launches"
    done = autotune_run("--device", "cpu", str(SCRIPTS / "cooperative_fit.py"), str(log),
                        "--fit", '{"margin": 2.0}')
    assert_autotune_error(done, 2, "margin must be a fraction")


@pytest.mark.slow  # two `autotune run`s of a torch job
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cooperative_device_cuda_without_a_gpu_exits_4(tmp_path: Path, autotune_run: RunHere) -> None:
    done = autotune_run("--device", "cuda", str(SCRIPTS / "cooperative_fit.py"), str(tmp_path / "log"))
    assert_autotune_error(done, 4, "device='cuda' but torch sees no CUDA GPU")


def test_nproc_per_node_with_a_global_batch_that_does_not_divide_is_refused_before_launch(
        tmp_path: Path, autotune_run: RunHere) -> None:
    log = tmp_path / "launches"
    done = autotune_run("--nproc-per-node", "2", "--global-batch-size", "5", "--device", "cpu",
                        str(SCRIPTS / "cooperative_fit.py"), str(log))
    assert done.returncode == 2, done.stderr
    assert "--global-batch-size 5 with --nproc-per-node 2" in done.stderr and "4 or 6" in done.stderr
    assert launches(log) == []


@pytest.mark.slow
def test_several_processes_that_never_initialise_torch_distributed_are_warned_about(
        tmp_path: Path, autotune_run: RunHere) -> None:
    log = tmp_path / "launches"
    done = autotune_run("--nproc-per-node", "2", "--global-batch-size", "4", "--device", "cpu",
                        "--budget", "64MiB", "--trial-steps", "1", str(SCRIPTS / "cooperative_fit.py"), str(log))
    assert done.returncode == 0, done.stderr
    assert launches(log) == ["launch 0 2", "launch 0 2"]
    assert "never initialised torch.distributed, so each rank tuned and trained alone" in done.stderr


def test_a_directory_as_script_is_a_usage_error(autotune_run: RunHere) -> None:
    done = autotune_run(str(SCRIPTS))
    assert done.returncode == 2 and "is a directory" in done.stderr, done.stderr


@pytest.mark.slow  # a fork server imports torch for the trial
def test_zero_change_passes_a_non_memory_exit_code_through(tmp_path: Path, autotune_run: RunHere) -> None:
    log = tmp_path / "launches"
    done = autotune_run("--global-batch-size", "8", "--device", "cpu", "--budget", "64MiB",
                        "--map", "micro_batch=--bs", "--map", "accumulation=--acc", str(SCRIPTS / "exit7.py"),
                        str(log))
    assert done.returncode == 7, done.stderr
    assert log.read_text().splitlines() == ["launch None"], "a failed trial is not retried, no real run started"


# -- the file at the cache path ---------------------------------------------------------------------------------------

def fit_counting_warnings(cache: object) -> tuple[Any, list[warnings.WarningMessage]]:
    model, batch = tiny_workload()
    with cache_warnings() as caught:
        plan = fit(model, batch, cache, max_trials=2)
    return plan, caught


def test_a_users_text_file_at_the_cache_path_is_never_renamed_or_replaced(tmp_path: Path) -> None:
    path = tmp_path / "plans.db"
    path.write_text("my notes, not a database\n" * 100)
    before = path.read_bytes()
    plan, caught = fit_counting_warnings(path)
    assert plan.source == "tuned"
    assert len(caught) == 1 and "autotune did not create it, so it leaves it alone" in str(caught[0].message)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plans.db"]


def test_a_missing_xdg_cache_home_is_created_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home" / "cache"))
    old = os.umask(0o022)
    try:
        PlanCache().close()
    finally:
        os.umask(old)
    for directory in (tmp_path / "home", tmp_path / "home" / "cache", tmp_path / "home" / "cache" / "autotune"):
        assert directory.stat().st_mode & 0o777 == 0o700, directory


@contextlib.contextmanager
def tiny_file_system(directory: Path, size: str = "256k") -> Iterator[Path]:
    """A small tmpfs mounted at `directory` (needs root), unmounted afterwards."""
    directory.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                                           capture_output=True, check=False).returncode != 0:
        pytest.skip("needs the right to mount a tmpfs to fill a disk for real")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


def fill(directory: Path) -> None:
    """Write zeros until the file system says no space is left (ENOSPC)."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)


def test_a_disk_already_full_when_the_cache_opens_is_named_full(tmp_path: Path) -> None:
    with tiny_file_system(tmp_path / "disk") as disk:
        with PlanCache(disk / "plans.db") as store:
            store.put(*sample(0))
        fill(disk)
        plan, caught = fit_counting_warnings(disk / "plans.db")
    assert plan.source == "tuned"
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "the disk (or the database's page limit) is full (0 KiB free" in str(caught[0].message)


def test_a_negative_budget_is_called_negative() -> None:
    from autotune.errors import InvalidSetting
    from autotune.sizes import parse_bytes

    with pytest.raises(InvalidSetting, match="memory_budget='-1GiB' is negative"):
        parse_bytes("-1GiB")


# -- tests independent of order ---------------------------------------------------------------------------------------

def test_an_in_process_run_command_leaves_autotunes_logger_as_it_found_it() -> None:
    import logging

    logger = logging.getLogger("autotune")
    before = (logger.handlers[:], logger.level, logger.propagate)
    result = CliRunner().invoke(main, ["run", "--map", "micro_batch=--bs", str(SCRIPTS / "exit7.py")])
    assert result.exit_code == 2, result.output  # it ran far enough to set up its logging, then failed
    assert (logger.handlers, logger.level, logger.propagate) == before


# -- connections and "nothing fits" -----------------------------------------------------------------------------------

def open_files_under(directory: Path) -> list[str]:
    import psutil

    return [f.path for f in psutil.Process().open_files() if f.path.startswith(str(directory))]


def test_no_connection_outlives_fit(tmp_path: Path) -> None:
    model, batch = tiny_workload()
    plans = [fit(model, batch, tmp_path / "plans.db", max_trials=2) for _ in range(30)]  # kept: nothing is collected
    assert [p.source for p in plans] == ["tuned"] + ["cache"] * 29
    assert open_files_under(tmp_path) == []


def test_nothing_fits_is_cached_so_a_retry_learns_it_at_once_and_retune_searches_again(tmp_path: Path) -> None:
    import time

    from autotune.errors import NoFeasiblePlan

    model, batch = tiny_workload()
    cache = tmp_path / "plans.db"
    settings = dict(global_batch_size=8, device="cpu", memory_budget="64KiB", cache=cache, trial_steps=1)
    with pytest.raises(NoFeasiblePlan) as searched:
        autotune_fit(model, batch, **settings)
    assert searched.value.trials and "cached under key" not in str(searched.value)
    started = time.perf_counter()
    with pytest.raises(NoFeasiblePlan, match="cached under key .*retune=True to search again") as cached:
        autotune_fit(model, batch, **settings)
    assert time.perf_counter() - started < 1.0
    assert str(searched.value) in str(cached.value) and cached.value.trials == searched.value.trials
    with pytest.raises(NoFeasiblePlan) as again:
        autotune_fit(model, batch, retune=True, **settings)
    assert "cached under key" not in str(again.value)


def autotune_fit(model: torch.nn.Module, batch: object, **settings: Any) -> Any:
    import autotune

    return autotune.fit(model, batch, **settings)


def test_a_search_cut_short_by_max_trials_is_not_cached_as_nothing_fits(tmp_path: Path) -> None:
    from autotune.errors import NoFeasiblePlan

    model, batch = tiny_workload()
    settings = dict(global_batch_size=8, device="cpu", memory_budget="135KiB", cache=tmp_path / "plans.db",
                    trial_steps=1)  # a search of 2 trials that finds nothing
    with pytest.raises(NoFeasiblePlan) as short:
        autotune_fit(model, batch, max_trials=1, **settings)
    assert len(short.value.trials) == 1
    with pytest.raises(NoFeasiblePlan) as full:  # more trials: the search runs again, not the cached refusal
        autotune_fit(model, batch, **settings)
    assert "cached under key" not in str(full.value) and len(full.value.trials) > 1
