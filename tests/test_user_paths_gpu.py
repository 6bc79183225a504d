"""The user's paths on a real GPU, run as a user runs them: the README's main command, the Python quick start
(`examples/fit_gpt.py`) and a cooperative `autotune run`, each with the default plan cache (a private
`AUTOTUNE_CACHE`, never `cache=False`), each launched twice so the second is served from the cache.

Each runs in its own process, as the user's would: the commands are read from README.md, not retyped."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from subprocess_env import with_path

from autotune.cache.store import PlanCache

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
TIMEOUT = 900
GPU_BUDGET = "8GiB"  # the README's budget stands in for a GPU's memory on the CPU; on a GPU, a small card's


def readme_main_command() -> list[str]:
    """The README's main command, less its install step, as argv: `autotune run ...`."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- main-command -->", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    command = block.replace("\\\n", " ").split("&&", 1)[1]
    argv = shlex.split(command)
    assert argv[:2] == ["autotune", "run"], argv
    return argv


def user_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")}
    return with_path(ROOT, base=env, AUTOTUNE_CACHE=str(tmp_path / "plans.db"), PYTHONUNBUFFERED="1")


def launch(tmp_path: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    if argv[0] == "autotune":
        argv = [sys.executable, "-m", "autotune", *argv[1:]]
    return subprocess.run(argv, cwd=ROOT, env=user_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT)


def cached_plans(tmp_path: Path) -> list:
    with PlanCache(tmp_path / "plans.db") as cache:
        return cache.list()


def test_the_readme_main_command_tunes_on_the_gpu_then_is_served_from_the_cache(tmp_path: Path) -> None:
    argv = readme_main_command()
    argv[argv.index("--budget") + 1] = GPU_BUDGET
    first = launch(tmp_path, argv)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "simulated" not in first.stderr, "on a GPU the trials run on the GPU"
    assert "plan (tuned)" in first.stderr and "autotune: trial 1:" in first.stderr, first.stderr[-4000:]
    assert len(cached_plans(tmp_path)) == 1, first.stderr[-4000:]
    second = launch(tmp_path, argv)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "plan (cached)" in second.stderr, second.stderr[-4000:]
    assert not re.search(r"autotune: trial \d+:", second.stderr), "a cached plan runs no trial"
    assert "ended: ok" in second.stderr


def test_the_python_quick_start_tunes_then_is_served_from_the_cache(tmp_path: Path) -> None:
    argv = [sys.executable, str(ROOT / "examples" / "fit_gpt.py"), "--steps", "5"]
    first = launch(tmp_path, argv)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "plan (tuned)" in first.stdout, first.stdout[-4000:]
    assert len(cached_plans(tmp_path)) == 1
    second = launch(tmp_path, argv)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "plan (cache)" in second.stdout, second.stdout[-4000:]
    assert "step   5" in second.stdout


def test_autotune_run_restarts_a_cooperative_job_after_a_real_cuda_oom(tmp_path: Path) -> None:
    log = tmp_path / "launches"
    argv = ["autotune", "run", "--global-batch-size", "32", "--budget", GPU_BUDGET,
            str(SCRIPTS / "cooperative_gpu_oom.py"), str(log)]
    done = launch(tmp_path, argv)
    assert done.returncode == 0, done.stderr[-4000:]
    launches = [line.split() for line in log.read_text().splitlines()]
    assert [int(r) for r, *_ in launches] == [0, 1], launches
    (_, first, _, source0), (_, second, accumulation, _) = launches
    assert source0 == "tuned"
    assert int(second) < int(first) and int(second) * int(accumulation) >= 32  # safer, same global batch
    assert "finished with micro-batch" in done.stdout + done.stderr
    # The OOM is stored against the job's own key: a third launch of the job starts below it.
    with PlanCache(tmp_path / "plans.db") as cache:
        keys = {e.key for e in cache.list()}
        assert any(cache.max_safe_micro_batch(k) is not None for k in keys), keys
