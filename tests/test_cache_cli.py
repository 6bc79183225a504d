"""`autotune cache ...`: every command through click's runner, on real cache files."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import click
import pytest
from cache_samples import sample
from click.testing import CliRunner
from subprocess_env import with_path

from autotune.cache import guard
from autotune.cache.store import PlanCache
from autotune.cli.cache import cache as cache_group
from autotune.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AUTOTUNE_CACHE", "AUTOTUNE_TEAM_DIR"):
        monkeypatch.delenv(name, raising=False)
    guard._warned.clear()


@pytest.fixture
def filled(tmp_path: Path) -> Path:
    """A cache with three plans, one of them seen to run out of memory at its micro-batch and one holding
    3 GiB on the host."""
    path = tmp_path / "plans.db"
    store = PlanCache(path)
    for i in range(3):
        plan, parts = sample(i)
        store.put(plan.with_evidence(host_peak_bytes=3 * 2**30) if i == 1 else plan, parts)
    store.mark_unsafe(sample(2)[0].key, micro_batch_size=4, shapes={"x": [4, 4]}, note="CUDA out of memory")
    return path


def run(*args: str, input: str | None = None) -> click.testing.Result:
    return CliRunner().invoke(main, ["cache", *args], input=input, catch_exceptions=False)


@pytest.mark.parametrize("name", sorted(cache_group.commands))
def test_every_command_has_help_with_an_example(name: str) -> None:
    result = run(name, "--help")
    assert result.exit_code == 0
    assert "Example" in result.output and f"autotune cache {name}" in result.output


def test_list_prints_a_table_and_json(filled: Path) -> None:
    result = run("--cache", str(filled), "list")
    assert result.exit_code == 0
    header, *rows = result.output.splitlines()
    assert header.split() == ["KEY", "MODEL", "GPU", "BUDGET", "PLAN", "HOST", "THROUGHPUT", "MFU", "AGE", "STATUS"]
    assert len(rows) == 3
    assert sum("3.00 GiB" in r for r in rows) == 1  # the host memory of the plan that keeps some there
    assert sum("unsafe: OOM at micro-batch 4" in r for r in rows) == 1
    assert all("Linear (20)" in r and "bf16, 4x2" in r for r in rows)

    listed = json.loads(run("--cache", str(filled), "list", "--json").output)
    assert {e["key"] for e in listed} == {sample(i)[0].key for i in range(3)}
    assert sorted(e["status"] for e in listed) == ["safe", "safe", "unsafe"]


def test_list_of_an_empty_cache_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "empty.db"))
    result = run("list")
    assert result.exit_code == 0 and "no cached plans in" in result.output and "empty.db" in result.output


def test_show_takes_a_key_prefix(filled: Path) -> None:
    plan = sample(2)[0]
    result = run("--cache", str(filled), "show", plan.key[:8])
    assert result.exit_code == 0
    assert plan.key in result.output and "OOMs seen in real training" in result.output
    assert "CUDA out of memory" in result.output and "simulated OOM" in result.output  # failures and trials

    shown = json.loads(run("--cache", str(filled), "show", plan.key[:8], "--json").output)
    assert shown["plan"]["config"]["micro_batch_size"] == 4 and shown["failures"][0]["shapes"] == {"x": [4, 4]}
    assert "host      nothing beyond the model's own copy" in result.output
    assert "HOST RISE" in result.output  # each trial's measured rise of the process's host memory
    host = run("--cache", str(filled), "show", sample(1)[0].key[:8]).output
    assert "host      3.00 GiB for its offload's buffers" in host

    missing = run("--cache", str(filled), "show", "zzzz")
    assert missing.exit_code == 1 and "autotune cache list" in missing.output
    ambiguous = run("--cache", str(filled), "show", "")
    assert ambiguous.exit_code == 1 and "give more of the key" in ambiguous.output


def test_export_then_import(filled: Path, tmp_path: Path) -> None:
    out = tmp_path / "team.jsonl"
    result = run("--cache", str(filled), "export", str(out))
    assert result.exit_code == 0 and "exported 3 row(s)" in result.output
    result = run("--cache", str(tmp_path / "new.db"), "import", str(out))
    assert result.exit_code == 0 and "imported 3 plan(s)" in result.output
    assert {e.key for e in PlanCache(tmp_path / "new.db").entries()} == {sample(i)[0].key for i in range(3)}


@pytest.mark.slow  # seconds: starts processes that import torch
def test_export_to_stdout_piped_into_import_from_stdin(filled: Path, tmp_path: Path) -> None:
    """`-` is standard output / input, through a real pipe between two processes; no file named `-` appears."""
    env = with_path(ROOT)
    command = [sys.executable, "-m", "autotune", "cache", "--cache"]
    exporter = subprocess.Popen([*command, str(filled), "export", "-"], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    importer = subprocess.run([*command, str(tmp_path / "new.db"), "import", "-"], cwd=tmp_path, env=env,
                              stdin=exporter.stdout, capture_output=True, text=True, timeout=120)
    exporter.stdout.close()
    assert exporter.wait(timeout=120) == 0, exporter.stderr.read()
    assert b"exported 3 row(s) to standard output" in exporter.stderr.read()
    assert importer.returncode == 0 and "imported 3 plan(s)" in importer.stdout, importer.stderr
    assert {e.key for e in PlanCache(tmp_path / "new.db").entries()} == {sample(i)[0].key for i in range(3)}
    assert not (tmp_path / "-").exists()


def test_import_lists_rejected_rows_and_fails(filled: Path, tmp_path: Path) -> None:
    out = tmp_path / "team.jsonl"
    run("--cache", str(filled), "export", str(out))
    rows = out.read_text().splitlines()
    bad = json.loads(rows[0])
    bad["plan"]["config"]["micro_batch_size"] = -1
    out.write_text("\n".join([json.dumps(bad), *rows[1:]]) + "\n")

    result = CliRunner().invoke(main, ["cache", "--cache", str(tmp_path / "new.db"), "import", str(out)])
    assert result.exit_code == 1
    assert "rejected line 1: plan: Configuration.micro_batch_size must be a positive integer, got -1" in result.output
    assert "imported 2 plan(s)" in result.output and "1 row(s)" in result.output


def test_clear_asks_first(filled: Path) -> None:
    declined = run("--cache", str(filled), "clear", input="n\n")
    assert declined.exit_code == 1 and len(PlanCache(filled).entries()) == 3
    result = run("--cache", str(filled), "clear", "--yes")
    assert result.exit_code == 0 and "deleted 3 plan(s)" in result.output
    assert PlanCache(filled).entries() == []


def test_delete_one_plan(filled: Path) -> None:
    key = sample(0)[0].key
    result = run("--cache", str(filled), "delete", key[:10])
    assert result.exit_code == 0 and key[:12] in result.output
    assert key not in {e.key for e in PlanCache(filled).entries()}


def test_path_follows_the_option_then_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert run("--cache", str(tmp_path / "a.db"), "path").output.strip() == str(tmp_path / "a.db")
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "b.db"))
    assert run("path").output.strip() == str(tmp_path / "b.db")


def test_an_unusable_cache_is_an_environment_error_naming_the_fix(tmp_path: Path) -> None:
    foreign = tmp_path / "app.db"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE users (name TEXT)")
    result = CliRunner().invoke(main, ["cache", "--cache", str(foreign), "list"])
    assert result.exit_code == 4
    assert "not an autotune plan cache" in result.output and "AUTOTUNE_CACHE" in result.output
