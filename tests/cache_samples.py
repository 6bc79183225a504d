"""Plans and workloads for the plan-cache tests: synthetic plans (fast) and a tiny GPT for real `fit` calls."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import autotune
from autotune.cache import guard
from autotune.cache.store import CacheWarning, key_parts, plan_key
from autotune.configuration import RUNG_FIELDS, Rung
from autotune.devices.placement import Placement
from autotune.evidence import Trial
from autotune.plan import Plan

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, GPTConfig, random_batch

TINY = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_embd=32)
GLOBAL_BATCH = 8
BUDGET = "64MiB"  # roomy: the tiny GPT fits at micro-batch 8 on the first rung


def sample(i: int = 0, *, micro: int = 4) -> tuple[Plan, dict]:
    """A valid plan and its key parts, different for each `i` (its budget differs), without running anything."""
    budget = 2**30 + i
    parts = key_parts(model=nn.Linear(4, 4), batch=torch.zeros(2, 4), global_batch_size=GLOBAL_BATCH, world_size=1,
                      placement=Placement(kind="cpu", name="cpu (simulated ceiling)", total_bytes=2**34),
                      budget_bytes=budget, techniques=frozenset({"bf16", "checkpointing", "offload"}), margin=0.1)
    steps = -(-GLOBAL_BATCH // micro)
    trials = (Trial(rung=Rung(), micro_batch_size=micro, outcome="ok", peak_bytes=1000 + i, seconds=0.5,
                    step_seconds=0.1, optimizer_seconds=0.01, samples_per_second=80.0 + i),
              Trial(rung=Rung(), micro_batch_size=2 * micro, outcome="oom", note="simulated OOM"))
    plan = Plan.of(precision="bf16", checkpointing="none", offload="none", micro_batch_size=micro,
                accumulation_steps=steps, world_size=1, global_batch_size=GLOBAL_BATCH,
                last_micro_batch_size=GLOBAL_BATCH - (steps - 1) * micro, peak_memory_bytes=1000 + i,
                memory_budget_bytes=budget, margin=0.1, samples_per_second=80.0 + i, tokens_per_second=None,
                device="cpu", device_name="cpu (simulated ceiling)", reason=f"sample {i}", trials=trials,
                key=plan_key(parts))
    return plan, parts


def set_plan_fields(d: dict, **fields: object) -> dict:
    """Set flat plan fields in a stored plan dict (`Plan.to_dict`), each in the part that holds it, as a forger
    editing an export would; returns `d`."""
    for name, value in fields.items():
        _part_holding(d, name)[name] = value
    return d


def _part_holding(d: dict, name: str) -> dict:
    if name in RUNG_FIELDS:
        return d["config"]["rung"]
    return next(d[part] for part in ("config", "evidence", "provenance") if name in d[part])


def tiny_workload() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A 2-layer, width-32 GPT and an example batch of 8 sequences of 16 tokens."""
    torch.manual_seed(0)
    return GPT(TINY), random_batch(TINY, GLOBAL_BATCH, torch.Generator().manual_seed(0))


def fit(model: nn.Module, batch: object, cache: object, **kwargs: object) -> Plan:
    """The real `autotune.fit` on the CPU under the simulated ceiling, with short trials."""
    return autotune.fit(model, batch, global_batch_size=GLOBAL_BATCH, device="cpu", memory_budget=BUDGET,
                        cache=cache, trial_steps=2, **kwargs)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No cache setting from the environment, and each test counts its own cache warnings (autouse in every
    module that imports it)."""
    for name in ("AUTOTUNE_CACHE", "AUTOTUNE_TEAM_DIR", "AUTOTUNE_RETUNE", "AUTOTUNE_MAX_MICRO_BATCH"):
        monkeypatch.delenv(name, raising=False)
    guard._warned.clear()


@contextlib.contextmanager
def cache_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """The plan cache's warnings raised inside the block (the list fills when the block ends)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found: list[warnings.WarningMessage] = []
        yield found
    found.extend(w for w in caught if issubclass(w.category, CacheWarning))
