"""The command line as a newcomer types it: `--cache FILE` after a cache subcommand, and one message per outcome."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cache_samples import sample
from click.testing import CliRunner

from autotune.cache.store import PlanCache
from autotune.cli.main import main


@pytest.fixture
def one_plan(tmp_path: Path) -> Path:
    path = tmp_path / "elsewhere.db"
    plan, parts = sample(0)
    PlanCache(path).put(plan, parts)
    return path


@pytest.mark.parametrize("where", ["after", "before"])
def test_cache_list_takes_cache_before_or_after_the_subcommand(one_plan: Path, where: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTUNE_CACHE", str(one_plan.parent / "default.db"))  # never the file listed
    args = ["cache", "list", "--cache", str(one_plan)] if where == "after" else ["cache", "--cache", str(one_plan),
                                                                                  "list"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "no cached plans" not in result.output and "KEY" in result.output.splitlines()[0], result.output


def test_the_cache_option_after_the_subcommand_wins(one_plan: Path) -> None:
    result = CliRunner().invoke(main, ["cache", "--cache", "/nowhere/a.db", "path", "--cache", str(one_plan)])
    assert result.exit_code == 0 and result.output.strip() == str(one_plan), result.output


@pytest.mark.slow  # seconds: starts processes that import torch
def test_a_script_that_tunes_nothing_is_told_so_once(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text("print('trained without autotune')\n")
    env = {**os.environ, "AUTOTUNE_CACHE": str(tmp_path / "plans.db")}
    done = subprocess.run([sys.executable, "-m", "autotune", "run", str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 5, done.stderr
    assert done.stderr.count("nothing was tuned") == 1, done.stderr
