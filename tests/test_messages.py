"""Messages in the user's language, whole: the command line's advice names its options, a budget without a
unit is questioned, notes are cut between words, tables label their units, and rates name their clock."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cache_samples import sample
from click.testing import CliRunner
from subprocess_env import with_path
from torch import nn

import autotune
from autotune.cache.store import PlanCache, plan_key
from autotune.cli.main import main
from autotune.cli.run import format_trials
from autotune.configuration import Rung
from autotune.evidence import Trial
from autotune.search.progress import describe
from autotune.supervisor import claims

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
OOM = ("OutOfMemoryError: simulated ceiling: 40.2 MiB live, over the 40.0 MiB budget (autotune's CPU stand-in "
       "for CUDA out of memory)")


def _env(tmp_path: Path) -> dict[str, str]:
    return with_path(ROOT, AUTOTUNE_CACHE=str(tmp_path / "plans.db"), OMP_NUM_THREADS="1")


@pytest.mark.slow  # seconds: starts processes that import torch
def test_nothing_fits_on_the_command_line_advises_its_options_not_fits_arguments(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "autotune", "run", "--global-batch-size", "4", "--budget", "1MiB",
                           "--trial-steps", "1", "--map", "micro_batch=--per_device_train_batch_size",
                           "--map", "accumulation=--gradient_accumulation_steps",
                           str(SCRIPTS / "zero_change_oom.py"), str(tmp_path / "out")],
                          cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=180)
    assert done.returncode == 3, done.stderr
    error = done.stderr.split("autotune: error: ", 1)[1]
    assert "Raise --budget" in error and "--map checkpointing=FLAG, --map bf16=FLAG" in error, error
    assert "memory_budget" not in error and "techniques=" not in error, error


@pytest.mark.parametrize("budget", ["40", "0.5", " 512 "])
def test_a_budget_string_without_a_unit_is_questioned(budget: str) -> None:
    hint = f"did you mean '{budget.strip()}GiB'"
    with pytest.raises(autotune.InvalidSetting, match=rf"memory_budget='{budget}' has no unit.*{hint}"):
        autotune.fit(nn.Linear(4, 4), torch.randn(2, 4), device="cpu", memory_budget=budget, cache=False)


def test_a_budget_without_a_unit_on_the_command_line_is_a_usage_error_with_the_hint() -> None:
    result = CliRunner().invoke(main, ["run", "--budget", "40", str(SCRIPTS / "exit7.py")])
    assert result.exit_code == 2 and "did you mean '40GiB'" in result.output, result.output


def test_bytes_as_an_integer_and_large_unitless_strings_stay_bytes() -> None:
    from autotune.sizes import parse_bytes

    assert parse_bytes(200_000) == 200_000 and parse_bytes("25769803776") == 24 * 2**30


def _ends_between_words(text: str, whole: str) -> bool:
    kept = text[:-3]
    return text.endswith("...") and whole.startswith(kept) and whole[len(kept)] in " ,;:("


def test_the_trial_table_and_progress_line_cut_an_oom_note_between_words() -> None:
    trial = Trial(rung=Rung(), micro_batch_size=16, outcome="oom", note=OOM)
    row = format_trials([trial]).splitlines()[1]
    note = row.split("oom", 1)[1].strip().lstrip("- ").strip()
    assert _ends_between_words(note, OOM), row
    line = describe(trial)
    assert _ends_between_words(line.split("oom, ", 1)[1], OOM), line


def test_cache_list_labels_the_rate_and_leaves_out_a_scripts_missing_parameter_count(tmp_path: Path) -> None:
    plan, parts = sample(0)
    parts = {**parts, "model": {"class": "script:/jobs/train.py", "digest": "0" * 64, "parameters": 0,
                                "trainable": 0}}
    path = tmp_path / "plans.db"
    with PlanCache(path) as store:
        store.put(plan.with_provenance(key=plan_key(parts)), parts)
    result = CliRunner().invoke(main, ["cache", "--cache", str(path), "list"])
    header, row = result.output.splitlines()[:2]
    assert "TOKENS/S" not in header and "THROUGHPUT" in header, header
    assert "80.0 samples/s" in row and "(0)" not in row and "script:/jobs/train.py" in row, row


def test_the_runs_rate_names_its_clock_and_the_examples_say_theirs_is_the_wall_clock() -> None:
    plan, _ = sample(0)
    run = claims.Measured(samples_per_second=5.0, steps=5, measured_steps=4, median_step_seconds=6.4)
    on_cpu = claims.describe(plan, run)
    assert "CPU time" in on_cpu and "by the wall clock differs" in on_cpu, on_cpu
    on_gpu = claims.describe(plan.with_provenance(device="cuda", device_name="NVIDIA H100"), run)
    assert "wall clock" in on_gpu and "CPU time" not in on_gpu, on_gpu
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "train_zero_change.py"), "--max_steps", "1",
                           "--layers", "1", "--width", "16", "--seq", "8", "--per_device_train_batch_size", "2"],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "samples/s (wall clock)" in done.stdout, done.stdout + done.stderr


@pytest.mark.slow  # seconds: starts processes that import torch
@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao (the optim8bit extra)")
def test_importing_the_8bit_optimizers_prints_no_torchao_loading_noise() -> None:
    done = subprocess.run([sys.executable, "-c", "from autotune.techniques.optimizer_8bit import backend; "
                           "print(backend('cpu')[0])"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "torchao", done.stderr
    assert "Failed to load" not in done.stderr and "register_constant" not in done.stderr, done.stderr


@pytest.mark.slow  # two processes importing torchao
def test_a_job_that_imports_torchao_shows_none_of_its_kernel_load_noise(tmp_path):
    """Inside a job `autotune run` starts (bootstrap), importing torchao (as transformers does) prints none of
    its "Failed to load" lines or torch's enum notice; its other warnings still show."""
    import os
    import subprocess
    import sys

    pytest.importorskip("torchao")
    script = tmp_path / "imports_torchao.py"
    script.write_text("import logging, torchao\nlogging.getLogger('torchao').warning('a warning of its own')\n")
    env = with_path(os.getcwd())
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    if "Failed to load" not in plain.stderr:
        pytest.skip("torchao loads all its kernels here: no noise to filter")
    job = subprocess.run([sys.executable, "-m", "autotune.supervisor.bootstrap", str(script)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert job.returncode == 0, job.stderr[-2000:]
    assert "Failed to load" not in job.stderr and "is an Enum subclass" not in job.stderr, job.stderr[-2000:]
    assert "a warning of its own" in job.stderr
