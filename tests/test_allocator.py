"""The CUDA allocator's expandable segments: on for the jobs `autotune run` starts and in `fit`'s process, unless
the user configured the allocator (autotune/devices/allocator.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autotune.devices import allocator

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 180


@pytest.mark.slow  # seconds: starts processes that import torch
@pytest.mark.parametrize("given", [None, "garbage_collection_threshold:0.8"], ids=["unset", "the user's"])
def test_autotune_run_starts_its_jobs_with_expandable_segments_unless_the_user_configured_the_allocator(
        tmp_path: Path, given: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k not in allocator.CONF_ENVS}
    env.update({"AUTOTUNE_CACHE": "off", "OMP_NUM_THREADS": "1"})
    if given:
        env["PYTORCH_CUDA_ALLOC_CONF"] = given
    seen = tmp_path / "seen"
    done = subprocess.run([sys.executable, "-m", "autotune", "run", str(ROOT / "tests/scripts/allocator_env.py"),
                           str(seen)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 5, done.stderr  # the job ran, and tuned nothing: it calls no fit
    assert seen.read_text() == (given or "expandable_segments:True")


def test_the_users_allocator_configuration_is_kept_and_named_in_the_plans_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator._CHOSEN, "note", None)  # this process's record, put back after the test
    assert allocator.job_environment({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) == {}
    note = allocator.expand_in_process({"PYTORCH_ALLOC_CONF": "expandable_segments:False"})
    assert note == "allocator as PYTORCH_ALLOC_CONF=expandable_segments:False sets it"
    assert allocator.note() == [note]


_PROBE = """
import torch
from autotune.devices import allocator
note = allocator.expand_in_process({})
x = torch.empty(64 * 2**20, device="cuda")  # a new segment, after the setting
segment = next(s for s in torch.cuda.memory_snapshot()
               if s["address"] <= x.data_ptr() < s["address"] + s["total_size"])
print(note)
print(segment["is_expandable"])
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fits_process_allocates_expandable_segments_after_cuda_started() -> None:
    env = {k: v for k, v in os.environ.items() if k not in allocator.CONF_ENVS}
    started = "import torch; torch.zeros(1, device='cuda')\n"  # CUDA running before fit, as a user's model is
    done = subprocess.run([sys.executable, "-c", started + _PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    note, expandable = done.stdout.strip().splitlines()[-2:]
    assert note.startswith("allocator: expandable segments"), note
    assert expandable == "True", done.stdout
