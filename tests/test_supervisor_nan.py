"""A zero-change run whose script prints a NaN loss: `autotune run` says so once, with what to check, and passes
every line of the script's output through as it was.

The run is real: `autotune run` tunes tests/scripts/zero_change_nan.py through its flags, then runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cache_samples import sample

from autotune.supervisor.loss_lines import LossWatch, non_finite_loss

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "zero_change_nan.py"
MAPS = ["--map", "micro_batch=--per_device_train_batch_size", "--map", "accumulation=--gradient_accumulation_steps"]


@pytest.mark.slow  # `autotune run` and its trial processes
def test_a_zero_change_run_that_prints_a_nan_loss_is_told_once() -> None:
    env = {**os.environ, "AUTOTUNE_CACHE": "off", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "autotune", "run", "--global-batch-size", "4", "--budget", "64MiB",
                           "--trial-steps", "1", *MAPS, str(SCRIPT), "--max_steps", "5"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)

    assert done.returncode == 0, done.stderr  # the script's own outcome: autotune tells, it does not stop the run
    # The script's lines reach stdout as it wrote them, every step.
    assert [line.split()[1:] for line in done.stdout.splitlines()] == [[str(n), "loss", "nan"] for n in range(1, 6)]
    told = [line for line in done.stderr.splitlines() if "not a finite number" in line]
    assert len(told) == 1, done.stderr
    assert told[0].startswith("autotune: ") and "'step    1  loss nan'" in told[0]
    assert "it is not the cause" in told[0] and "check the learning rate, the data" in told[0]


@pytest.mark.parametrize("line", [
    "step    5  loss nan  1,234.5 samples/s", "loss: NaN", "{'loss': nan, 'grad_norm': 1.0, 'epoch': 0.1}",
    "train_loss=inf", "val loss -inf", 'epoch 1 "loss": Infinity', "loss tensor(nan, grad_fn=<MeanBackward0>)"])
def test_a_non_finite_loss_is_read_in_the_forms_training_scripts_print(line: str) -> None:
    assert non_finite_loss(line)


@pytest.mark.parametrize("line", [
    "step 5  loss 0.3127", "loss: 1e-3 (nan-safe)", "lossy compression", "loss inference done", "nan in the data",
    "grad_norm: nan"])
def test_a_finite_loss_or_another_nan_is_not_taken_for_one(line: str) -> None:
    assert not non_finite_loss(line)


def test_a_plan_that_turns_on_bf16_or_compile_is_named_as_a_suspect() -> None:
    plan = sample(0)[0]
    watch = LossWatch(plan.with_config(precision="bf16", compile=True))
    watch("step 1  loss nan")
    watch("step 2  loss nan")
    assert watch.seen == "step 1  loss nan"  # the first line is kept; the later ones say nothing new
    message = watch.message()
    assert "turns on bf16 and compile through the script's flags" in message
    assert "AUTOTUNE_TECHNIQUES=checkpointing" in message and "not the cause" not in message
