"""Bad numbers are refused with a message naming the setting (Python: `InvalidSetting`; command line: exit 2
and one line), never a MemoryError, an OverflowError, a traceback or an "out of memory" verdict; and a cache
path whose home directory does not exist costs the cache, never the training."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import autotune
from autotune.cache.store import CacheWarning
from autotune.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
EXIT7 = str(ROOT / "tests" / "scripts" / "exit7.py")  # exits 7 at once: a launch shows as exit 7, not 2


def _fit(**settings: object) -> autotune.Plan:
    """A small fit on the CPU; `settings` override its arguments."""
    args: dict[str, object] = dict(device="cpu", memory_budget="64MiB", cache=False, trial_steps=1, max_trials=3,
                                   progress=False, loss_fn=lambda model, batch: model(batch).sum())
    args.update(settings)
    model = args.pop("model", None) or nn.Linear(4, 4)
    return autotune.fit(model, torch.randn(2, 4), **args)  # type: ignore[arg-type]


def _no_such_home() -> str:
    """A `~user` prefix naming no user of this machine (a new name each time: the cache warns once a path)."""
    return f"~autotune-no-such-user-{uuid.uuid4().hex[:12]}"


# -- fit ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size,shown", [(10**12, "1000000000000"), (99999999999999999999, "99999999999999999999"),
                                        (10**5000, "about 2")], ids=["1e12", "1e20", "1e5000"])
def test_a_global_batch_beyond_any_training_step_is_refused_before_any_trial(size: int, shown: str) -> None:
    with pytest.raises(autotune.InvalidSetting,
                       match=rf"global_batch_size \({shown}.*\) is too large: "
                             r"at most 1,048,576 samples per optimizer step"):
        _fit(global_batch_size=size)


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), "nanGiB", "1" * 400 + "GiB", 10**400],
                         ids=["nan", "inf", "nanGiB", "400-digit-GiB", "1e400"])
def test_a_budget_that_is_not_a_number_of_bytes_is_refused_naming_memory_budget(budget: object) -> None:
    with pytest.raises(autotune.InvalidSetting, match=r"memory_budget=.*(not a memory size|not a size).*'24GiB'"):
        _fit(memory_budget=budget)


@pytest.mark.parametrize("margin", [float("nan"), float("inf"), True])
def test_a_margin_that_is_not_a_fraction_is_refused(margin: object) -> None:
    with pytest.raises(autotune.InvalidSetting, match=r"margin must be a fraction in \[0, 0.9\)"):
        _fit(margin=margin)


@pytest.mark.parametrize("techniques", [123, 4.5, {"bf16": True}, ["bf16", 1]])
def test_techniques_that_are_not_names_are_refused_with_an_example(techniques: object) -> None:
    with pytest.raises(autotune.InvalidSetting, match=r"techniques must be technique names, e.g. techniques=\("):
        _fit(techniques=techniques)


def test_an_optimizer_over_another_models_parameters_is_refused() -> None:
    other = torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1)
    with pytest.raises(autotune.InvalidSetting, match=r"optimizer holds none of the model's trainable parameters "
                                                      r"\(all 2 of its parameters belong to another model\).*SGD\("):
        _fit(optimizer=other)


def test_an_optimizer_over_the_models_frozen_parameters_only_is_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].requires_grad_(False)
    frozen = torch.optim.AdamW(model[0].parameters())
    with pytest.raises(autotune.InvalidSetting, match=r"2 of its 2 parameters are the model's but frozen"):
        _fit(model=model, optimizer=frozen)


def test_an_unknown_users_home_in_autotune_cache_trains_without_the_cache_and_warns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = _no_such_home()
    monkeypatch.setenv("AUTOTUNE_CACHE", f"{home}/x.db")
    monkeypatch.chdir(tmp_path)
    with pytest.warns(CacheWarning, match=rf"plan cache {home}/x.db \(no home directory is known for {home}\)"):
        plan = _fit(cache=None)
    assert plan.source == "tuned" and plan.trials
    assert list(tmp_path.iterdir()) == []  # no directory named "~user" made here


def test_an_unknown_users_home_in_autotune_team_dir_trains_without_the_team_directory_and_warns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = _no_such_home()
    monkeypatch.setenv("AUTOTUNE_TEAM_DIR", f"{home}/x")
    monkeypatch.chdir(tmp_path)
    with pytest.warns(CacheWarning) as caught:
        plan = _fit(cache=tmp_path / "plans.db")
    assert plan.source == "tuned" and plan.trials
    assert [str(w.message) for w in caught] == [
        f"team directory {home}/x ($AUTOTUNE_TEAM_DIR) skipped: no home directory is known for {home}"]
    assert (tmp_path / "plans.db").exists()  # the local cache still works
    assert not any(p.name.startswith("~") for p in tmp_path.iterdir())


# -- the command line --------------------------------------------------------------------------------------

def _one_line_usage_error(args: list[str]) -> str:
    """The stderr of `autotune run ARGS`, asserting it is a usage error of one line and no traceback."""
    result = CliRunner().invoke(main, ["run", *args])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune: error: "), result.stderr
    assert "Traceback" not in result.output and "out of memory" not in result.output
    return lines[0]


@pytest.mark.parametrize("size", ["99999999999999999999", str(10**12)])
def test_run_refuses_a_huge_global_batch_with_exit_2_and_one_line(size: str, tmp_path: Path) -> None:
    line = _one_line_usage_error(["--global-batch-size", size, EXIT7, str(tmp_path / "launches")])
    assert f"--global-batch-size ({size}) is too large: at most 1,048,576 samples per optimizer step" in line
    assert not (tmp_path / "launches").exists()  # refused before any launch


@pytest.mark.parametrize("option,value", [("--trial-timeout", "nan"), ("--grace-period", "inf"), ("--margin", "nan"),
                                          ("--margin", "inf")])
def test_run_refuses_a_non_finite_number_with_exit_2_and_one_line(option: str, value: str, tmp_path: Path) -> None:
    line = _one_line_usage_error([option, value, EXIT7, str(tmp_path / "launches")])
    assert option in line and f"{value} is not a finite number" in line


@pytest.mark.parametrize("args", [["--budget", "nanGiB"], ["--budget", "inf"], ["--global-batch-size", "0"],
                                  ["--global-batch-size", "1e12"]])
def test_run_usage_errors_are_one_line_naming_the_option(args: list[str], tmp_path: Path) -> None:
    line = _one_line_usage_error([*args, EXIT7, str(tmp_path / "launches")])
    assert args[0] in line


def test_run_in_zero_change_mode_refuses_a_huge_global_batch_before_tuning(tmp_path: Path) -> None:
    """Splitting 10**20 samples into micro-batch sizes once walked every divisor candidate: a hang, not an error."""
    env = {**os.environ, "AUTOTUNE_CACHE": str(tmp_path / "plans.db")}
    done = subprocess.run([sys.executable, "-m", "autotune", "run", "--global-batch-size", str(10**20), "--budget",
                           "40MiB", "--map", "micro_batch=--bs", "--map", "accumulation=--acc", EXIT7,
                           str(tmp_path / "launches")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"autotune: error: --global-batch-size ({10**20}) is too large: at most 1,048,576 samples per optimizer "
        "step over all ranks; pass the samples of one optimizer step (e.g. 64), not of an epoch or a run."]


def test_run_prints_a_cache_warning_as_one_plain_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Zero-change mode opens the cache in the supervisor; the script then fails its first trial (exit 7)."""
    home = _no_such_home()
    monkeypatch.setenv("AUTOTUNE_CACHE", f"{home}/x.db")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["run", "--global-batch-size", "8", "--budget", "40MiB", "--map",
                                       "micro_batch=--bs", "--map", "accumulation=--acc", EXIT7,
                                       str(tmp_path / "launches")])
    assert result.exit_code == 7, result.output
    warned = [line for line in result.stderr.splitlines() if "x.db" in line]
    assert warned == [f"autotune: warning: plan cache {home}/x.db (no home directory is known for {home}): it "
                      "cannot be written here. Set AUTOTUNE_CACHE to a writable path, or pass cache=False; to share "
                      "plans read-only, use AUTOTUNE_TEAM_DIR instead."], result.stderr
    assert "CacheWarning" not in result.stderr and "warnings.warn" not in result.stderr
    assert not any(p.name.startswith("~") for p in tmp_path.iterdir())


@pytest.mark.slow  # seconds: starts processes that import torch
def test_run_prints_the_jobs_cache_warning_as_one_plain_line(tmp_path: Path) -> None:
    """Cooperative mode: `fit` opens the cache inside the job's own process, and warns there."""
    home = _no_such_home()
    env = {**os.environ, "AUTOTUNE_CACHE": f"{home}/x.db", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "autotune", "run", "--device", "cpu", "--budget", "64MiB",
                           "--trial-steps", "1", str(ROOT / "tests" / "scripts" / "cooperative_fit.py"),
                           str(tmp_path / "launches")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    warned = [line for line in done.stderr.splitlines() if "x.db" in line]
    assert warned == [f"autotune: warning: plan cache {home}/x.db (no home directory is known for {home}): it "
                      "cannot be written here. Set AUTOTUNE_CACHE to a writable path, or pass cache=False; to share "
                      "plans read-only, use AUTOTUNE_TEAM_DIR instead."], done.stderr
    assert "CacheWarning" not in done.stderr and "warnings.warn" not in done.stderr and "PlanCache(" not in done.stderr
    assert not any(p.name.startswith("~") for p in tmp_path.iterdir())
