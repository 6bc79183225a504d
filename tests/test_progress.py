"""Progress while tuning: a live line on a terminal (a real pseudo-terminal), plain lines elsewhere, and
nothing on stdout, so `--json` output stays the plan alone."""

from __future__ import annotations

import io
import json
import os
import pty
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from subprocess_env import with_path

from autotune.configuration import Rung
from autotune.evidence import Trial
from autotune.plan import Plan
from autotune.search.progress import Progress, progress_for

ROOT = Path(__file__).resolve().parents[1]
ERASE = "\r\x1b[2K"
FIT = """
import torch, autotune
model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
plan = autotune.fit(model, torch.randn(8, 32), global_batch_size=16, device="cpu", memory_budget="4MiB",
                    cache=False, trial_steps=1, loss_fn=lambda m, b: m(b).square().mean(){progress})
print("PLAN", plan.micro_batch_size)
"""


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_PROGRESS"}
    return with_path(ROOT, base=env, AUTOTUNE_CACHE=str(tmp_path / "plans.db"), OMP_NUM_THREADS="1")


def run_with_stderr_on_a_terminal(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """Run `argv` with stderr on a pseudo-terminal and stdout on a pipe: (exit code, stdout, terminal text)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=slave)
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: every holder of the terminal's other side has closed it
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
        reader.join(10)
        os.close(master)
    return proc.returncode, out.decode(), b"".join(chunks).decode(errors="replace")


@pytest.mark.slow  # a torch process with a fit
def test_fit_draws_a_live_line_per_trial_on_a_terminal_by_default(tmp_path: Path) -> None:
    code, out, terminal = run_with_stderr_on_a_terminal([sys.executable, "-c", FIT.format(progress="")],
                                                        _env(tmp_path))
    assert code == 0, terminal
    assert "PLAN" in out and "trial" not in out  # progress never goes to stdout
    assert ERASE in terminal and "running..." in terminal, terminal
    finished = [line for line in terminal.replace(ERASE, "\n").splitlines() if "samples/s" in line]
    assert finished and all("micro-batch" in line and "trial(s)" in line for line in finished), terminal


@pytest.mark.slow  # two torch processes, each a fit
def test_fit_says_nothing_off_a_terminal_unless_asked_and_then_plain_lines(tmp_path: Path) -> None:
    quiet = subprocess.run([sys.executable, "-c", FIT.format(progress="")], cwd=ROOT, env=_env(tmp_path),
                           capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and "trial" not in quiet.stderr, quiet.stderr  # a library is silent by default
    asked = subprocess.run([sys.executable, "-c", FIT.format(progress=", progress=True")], cwd=ROOT,
                           env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert asked.returncode == 0, asked.stderr
    lines = [line for line in asked.stderr.splitlines() if line.startswith("autotune: trial")]
    assert lines and "\x1b" not in asked.stderr and "\r" not in asked.stderr, asked.stderr


@pytest.mark.slow  # `autotune run` and its trial processes
def test_run_json_keeps_stdout_for_the_plan_while_the_terminal_shows_progress(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "autotune", "run", "--json", "--tune-only", "--global-batch-size", "8",
            "--budget", "8MiB", "--trial-steps", "1", "--map", "micro_batch=--per_device_train_batch_size",
            "--map", "accumulation=--gradient_accumulation_steps",
            str(ROOT / "tests" / "scripts" / "zero_change_oom.py"), str(tmp_path / "final")]
    code, out, terminal = run_with_stderr_on_a_terminal(argv, _env(tmp_path))
    assert code == 0, terminal
    plan = Plan.from_dict(json.loads(out))  # the plan, and nothing else
    assert ERASE in terminal and "running..." in terminal, terminal
    assert terminal.count("micro-batch") >= len(plan.trials), terminal


def test_plain_lines_say_configuration_outcome_throughput_count_and_time() -> None:
    stream = io.StringIO()
    progress = Progress(stream, live=False, direct=True)
    runner = progress.watch(lambda rung, micro: Trial(rung=rung, micro_batch_size=micro, outcome="ok",
                                                      peak_bytes=3 * 2**20, samples_per_second=42.0))
    runner(Rung(checkpointing="full"), 4)
    line = stream.getvalue()
    assert line.startswith("autotune: trial 1: bf16+full ckpt at micro-batch 4: ok, peak 3.0 MiB, 42.0 samples/s")
    assert "(1 trial(s), " in line and line.endswith(" s)\n")


def test_the_live_line_says_when_a_trial_waits_on_pinning_host_memory_and_the_end_says_what_it_raised() -> None:
    stream = io.StringIO()
    progress = Progress(stream, live=True)
    offload = Rung(offload="optimizer")
    drawn: list[str] = []

    def run(rung: Rung, micro: int, **kw: object) -> Trial:
        drawn.append(stream.getvalue())  # what the terminal shows while the trial runs
        return Trial(rung=rung, micro_batch_size=micro, outcome="ok", peak_bytes=2**30, samples_per_second=9.0,
                     host_peak_bytes=5 * 2**30 if rung.offload != "none" else 0)

    runner = progress.watch(run, host_bytes=lambda rung, kw: 4 * 2**30 if rung.offload != "none" else 0)
    runner(offload, 2)
    runner(Rung(), 2)
    assert "allocating 4.00 GiB of host memory for the offloaded optimizer, then running..." in drawn[0]
    assert "allocating" not in drawn[1].split(ERASE)[-1]  # nothing to pin: plainly running
    assert "optimizer offload at micro-batch 2: ok, peak 1.00 GiB, host +5.00 GiB, 9.0 samples/s" in stream.getvalue()


def test_progress_false_is_off_and_the_environment_can_ask_for_a_live_line(monkeypatch) -> None:
    assert progress_for(False) is None
    monkeypatch.setenv("AUTOTUNE_PROGRESS", "live")
    assert progress_for(None, io.StringIO()).live
    monkeypatch.setenv("AUTOTUNE_PROGRESS", "off")
    assert progress_for(None, io.StringIO()) is None
