"""Faults met after `fit` and inside it: where a recovery writes, memory taken since tuning, and a
poisoned CUDA context whose clean-up fails too.

Real `fit` and `plan.apply` on the CPU under the simulated ceiling. Where the decision reads the device, the
reading is faked at its source (the host's free memory, the CUDA clean-up call), as STYLE.md 10 says.
"""

from __future__ import annotations

import logging
import types
from pathlib import Path

import pytest
import torch
from cache_samples import fit as fit_tiny
from cache_samples import tiny_workload
from test_step import new_model, seq_batch, sgd
from torch import nn

import autotune
from autotune.cache.store import PlanCache
from autotune.devices import placement as placement_module
from autotune.errors import DeviceError
from autotune.search import trial as trial_module
from autotune.search.snapshot import Snapshot

ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AUTOTUNE_CACHE", "AUTOTUNE_TEAM_DIR", "AUTOTUNE_RETUNE", "AUTOTUNE_MAX_MICRO_BATCH",
                 "AUTOTUNE_TECHNIQUES"):
        monkeypatch.delenv(name, raising=False)


# -- a recovery writes to the cache the plan came from ----------------------------------------------------------------

@pytest.mark.parametrize("elsewhere", ["AUTOTUNE_CACHE", "the user cache"])
def test_a_recovery_in_training_writes_to_the_cache_the_plan_came_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       elsewhere: str) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    if elsewhere == "AUTOTUNE_CACHE":
        monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "mine.db"))
    team = tmp_path / "team.db"
    model = new_model()
    plan = autotune.fit(model, seq_batch(8, 8, seed=5), global_batch_size=8, optimizer=sgd(model.parameters()),
                        memory_budget=200_000, device="cpu", techniques=("checkpointing",), cache=str(team))
    step = plan.apply(model, sgd(model.parameters()))
    step(seq_batch(8, 64, seed=6))  # 8x longer than the trials saw: out of memory, recovered
    assert step.recoveries and step.plan.micro_batch_size < plan.micro_batch_size

    with PlanCache(team) as store:
        [entry] = store.entries(plan.key)
    failed = sorted((f.micro_batch_size for f in entry.failures), reverse=True)
    assert failed[0] == plan.micro_batch_size and len(failed) == len(step.recoveries)  # each halving, recorded
    assert entry.plan.micro_batch_size == step.plan.micro_batch_size
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".db") == ["team.db"]
    assert not (home / ".cache").exists(), "nobody asked for the user cache"


# -- memory taken since tuning ----------------------------------------------------------------------------------------

def host_with(monkeypatch: pytest.MonkeyPatch, *, available: float, total: int | None = None) -> None:
    """The host's memory as `default_budget` reads it (the simulated device's free memory), faked at psutil."""
    real = placement_module.psutil.virtual_memory()
    fake = types.SimpleNamespace(available=int(available), total=real.total if total is None else total)
    monkeypatch.setattr(placement_module, "psutil", types.SimpleNamespace(virtual_memory=lambda: fake))


def test_fit_without_a_budget_is_a_cache_hit_the_second_time(tmp_path: Path) -> None:
    model, batch = tiny_workload()
    plans = [autotune.fit(model, batch, global_batch_size=8, device="cpu", cache=tmp_path / "plans.db",
                          trial_steps=1, max_trials=2) for _ in range(2)]
    assert [p.source for p in plans] == ["tuned", "cache"]
    assert plans[1].key == plans[0].key


def test_a_default_budget_hit_is_served_only_while_todays_free_memory_covers_its_peak(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch = tiny_workload()
    cache = tmp_path / "plans.db"

    def fit_with(available: float) -> autotune.Plan:
        host_with(monkeypatch, available=available, total=64 * 2**20)  # budget steps of 1 MiB
        return autotune.fit(model, batch, global_batch_size=8, device="cpu", cache=cache, trial_steps=1,
                            max_trials=2)

    tuned = fit_with(4.5 * 2**20)
    assert tuned.source == "tuned" and tuned.memory_budget_bytes == 4 * 2**20  # rounded down to a whole step
    needs = tuned.peak_memory_bytes / (1 - tuned.margin)  # free memory the plan needs to keep its margin
    assert fit_with(4.9 * 2**20).source == "cache"  # the same step
    assert fit_with(1.02 * needs).source == "cache"  # steps below, but its peak still fits
    try:
        again = fit_with(0.97 * needs)
    except autotune.NoFeasiblePlan:
        return  # nothing fits today: also not the cached plan
    assert again.source == "tuned" and again.peak_memory_bytes <= (1 - again.margin) * 0.97 * needs


def test_a_cached_plan_or_an_applied_one_that_no_longer_fits_is_warned_about_with_the_figures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    model, batch = tiny_workload()
    tuned = fit_tiny(model, batch, tmp_path / "plans.db")
    host_with(monkeypatch, available=100 * 2**10)  # another job took the memory since
    caplog.set_level(logging.WARNING, logger="autotune")
    hit = fit_tiny(model, batch, tmp_path / "plans.db")
    assert hit.source == "cache" and hit.micro_batch_size == tuned.micro_batch_size  # memory_budget stands
    peak = placement_module.format_bytes(tuned.peak_memory_bytes)
    [served] = [r.getMessage() for r in caplog.records]
    assert f"the cached plan peaks at {peak} but only 100 KiB is usable on cpu (simulated ceiling) now" in served
    caplog.clear()
    hit.apply(model)
    [applied] = [r.getMessage() for r in caplog.records]
    assert f"the plan peaks at {peak} but only 100 KiB is usable" in applied and "retune=True" in applied


# -- a poisoned CUDA context ------------------------------------------------------------------------------------------

class PoisonedInTrials(nn.Module):
    """The tiny GPT, whose forward raises CUDA's illegal-address error once a trial's steps run (the forwards
    that profile blocks and count FLOPs before the trials pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt, _ = tiny_workload()
        self.poisoned = False

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.poisoned:
            raise RuntimeError(ILLEGAL_ADDRESS)  # what torch raises (torch.AcceleratorError is a RuntimeError)
        return self.gpt(idx, targets)


def test_a_device_error_survives_clean_up_that_would_call_cuda_again(monkeypatch: pytest.MonkeyPatch) -> None:
    model = PoisonedInTrials()
    cleanups: list[object] = []
    run_steps = trial_module._run_steps

    def poisoned_steps(*args: object, **kwargs: object) -> object:  # the real steps, on a context gone bad
        model.poisoned = True
        return run_steps(*args, **kwargs)

    def release_memory(placement: object, reset_peak: bool = False) -> None:  # as CUDA would, once poisoned
        cleanups.append(placement)
        raise RuntimeError(ILLEGAL_ADDRESS)

    def restore(self: Snapshot) -> None:  # copying the weights back onto a poisoned device fails too
        raise RuntimeError(ILLEGAL_ADDRESS)

    monkeypatch.setattr(trial_module, "_run_steps", poisoned_steps)
    monkeypatch.setattr(trial_module, "release_memory", release_memory)
    monkeypatch.setattr(Snapshot, "restore", restore)
    _, batch = tiny_workload()
    with pytest.raises(DeviceError, match="during a trial of .*illegal memory access") as raised:
        autotune.fit(model, batch, device="cpu", memory_budget="64MiB", cache=False)
    assert cleanups == [], "no CUDA call after a poisoned context"
    assert any("restoring the model afterwards failed too" in n for n in getattr(raised.value, "__notes__", []))


def test_a_context_found_poisoned_in_clean_up_is_a_device_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def release_memory(placement: object, reset_peak: bool = False) -> None:  # the error surfaces asynchronously
        raise RuntimeError(ILLEGAL_ADDRESS)

    monkeypatch.setattr(trial_module, "release_memory", release_memory)
    model, batch = tiny_workload()
    with pytest.raises(DeviceError, match="while cleaning up after a trial.*illegal memory access") as raised:
        autotune.fit(model, batch, device="cpu", memory_budget="64MiB", cache=False)
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_a_plan_from_fit_holds_no_cache_handle_and_can_be_copied_and_pickled(tmp_path: Path) -> None:
    import copy
    import pickle

    model, batch = tiny_workload()
    plan = fit_tiny(model, batch, tmp_path / "plans.db", max_trials=1)
    # a plan is a configuration; a recovery reaches fit's cache through the callback fit registered, by key
    assert not hasattr(plan, "cache")
    for twin in (copy.deepcopy(plan), pickle.loads(pickle.dumps(plan))):
        assert twin == plan and twin.key == plan.key
        assert PlanCache(tmp_path / "plans.db").get(plan.key) == plan.with_provenance(source="tuned")


def test_a_context_found_poisoned_while_training_cleans_up_after_an_oom_is_a_device_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from autotune.training import step as step_module

    def release_memory(placement: object, reset_peak: bool = False) -> None:
        raise RuntimeError(ILLEGAL_ADDRESS)

    model = new_model()
    plan = autotune.fit(model, seq_batch(8, 8, seed=5), global_batch_size=8, optimizer=sgd(model.parameters()),
                        memory_budget=200_000, device="cpu", techniques=("checkpointing",), cache=False)
    step = plan.apply(model, sgd(model.parameters()))
    monkeypatch.setattr(step_module, "release_memory", release_memory)
    with pytest.raises(DeviceError, match="while cleaning up after an OOM in training.*illegal memory access"):
        step(seq_batch(8, 64, seed=6))  # out of memory: the clean-up before the re-run finds the context poisoned
