"""An on/off variable takes on or off, in a few spellings; anything else is refused naming the variable and the
values it takes, wherever it is read (fit, a trial, `autotune run`), never taken for one side."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpt import GPT, GPTConfig, random_batch
from subprocess_env import with_path
from torch import nn

import autotune
from autotune import settings

ROOT = Path(__file__).resolve().parents[1]
SWITCHES = [settings.OFFLOAD_STREAM_ENV, settings.OFFLOAD_OVERLAP_ENV, settings.OFFLOAD_PARTITION_ENV,
            settings.ATTENTION_BUCKETS_ENV, settings.FORK_TRIALS_ENV]
REFUSED = r"='maybe' is neither on nor off: set it to one of 1, true, yes, on \(on\) or 0, false, no, off \(off\)"


@pytest.mark.parametrize("value, expected", [("1", True), ("TRUE", True), (" yes ", True), ("On", True),
                                             ("0", False), ("false", False), ("No", False), ("OFF", False)])
def test_each_spelling_of_on_and_off_is_read(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    monkeypatch.setenv(settings.OFFLOAD_STREAM_ENV, value)
    assert settings.switch(settings.OFFLOAD_STREAM_ENV, default=not expected) is expected


@pytest.mark.parametrize("default", [True, False])
def test_unset_or_empty_is_the_default(monkeypatch: pytest.MonkeyPatch, default: bool) -> None:
    monkeypatch.delenv(settings.OFFLOAD_STREAM_ENV, raising=False)
    assert settings.switch(settings.OFFLOAD_STREAM_ENV, default=default) is default
    monkeypatch.setenv(settings.OFFLOAD_STREAM_ENV, " ")
    assert settings.switch(settings.OFFLOAD_STREAM_ENV, default=default) is default


@pytest.mark.parametrize("name", SWITCHES)
def test_a_garbage_value_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(autotune.InvalidSetting, match=name + REFUSED):
        settings.switch(name)


def _offloadable() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), torch.randn(8, 16)


def _fit(model: nn.Module, batch: object, **kw: object) -> autotune.Plan:
    kw.setdefault("cache", False)
    return autotune.fit(model, batch, device="cpu", memory_budget="64MiB", trial_steps=1, max_trials=4,
                        loss_fn=kw.pop("loss_fn", lambda m, b: m(b).pow(2).mean()), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", [settings.OFFLOAD_STREAM_ENV, settings.OFFLOAD_OVERLAP_ENV,
                                  settings.OFFLOAD_PARTITION_ENV])
def test_fit_with_a_garbage_offload_switch_names_it(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(autotune.InvalidSetting, match=name + REFUSED):
        _fit(*_offloadable(), techniques=("bf16", "offload"))


def test_fit_with_a_garbage_retune_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTUNE_RETUNE", "maybe")
    with pytest.raises(autotune.InvalidSetting, match="AUTOTUNE_RETUNE" + REFUSED):
        _fit(*_offloadable())


def test_fit_of_a_token_model_with_garbage_attention_buckets_names_it(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    monkeypatch.setenv(settings.ATTENTION_BUCKETS_ENV, "maybe")
    cfg = GPTConfig(vocab_size=64, n_layer=2, n_embd=32, n_head=2, seq_len=16)
    with pytest.raises(autotune.InvalidSetting, match=settings.ATTENTION_BUCKETS_ENV + REFUSED):
        _fit(GPT(cfg), random_batch(cfg, 2), cache=tmp_path / "plans.db", loss_fn=None)


@pytest.mark.slow  # seconds: starts processes that import torch
def test_autotune_run_with_garbage_fork_trials_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    env = with_path(ROOT, AUTOTUNE_CACHE=str(tmp_path / "plans.db"), OMP_NUM_THREADS="1",
                    **{settings.FORK_TRIALS_ENV: "maybe"})
    done = subprocess.run([sys.executable, "-m", "autotune", "run", "--global-batch-size", "4", "--budget", "64MiB",
                           "--trial-steps", "1", "--map", "micro_batch=--per_device_train_batch_size",
                           "--map", "accumulation=--gradient_accumulation_steps",
                           str(ROOT / "tests" / "scripts" / "zero_change_oom.py"), str(tmp_path / "out")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert f"{settings.FORK_TRIALS_ENV}='maybe' is neither on nor off" in done.stderr, done.stderr
