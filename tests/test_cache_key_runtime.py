"""Every key a plan can have is one the cache stores and serves: the runtime part of a key (torch, CUDA, the
allocator setting, the length attention is padded to) and the cache's check of it agree, on the CPU and CUDA
forms, with each switch on and off."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from cache_samples import clean_environment, fit, sample, set_plan_fields, tiny_workload  # noqa: F401 - autouse fixture
from torch import nn

from autotune.cache.key import RUNTIME_FIELDS, check_parts
from autotune.cache.store import PlanCache, key_parts, plan_key
from autotune.devices.placement import Placement
from autotune.plan import Plan

PLACEMENTS = {"cpu": Placement(kind="cpu", name="cpu (simulated ceiling)", total_bytes=2**34),
              "cuda": Placement(kind="cuda", name="NVIDIA H200", total_bytes=141 * 2**30)}
SWITCHES = list(itertools.product(("cpu", "cuda"), (None, "0", "1"), (None, "expandable_segments:True"),
                                  (False, True)))


@pytest.mark.parametrize(("kind", "buckets", "alloc", "offload"), SWITCHES)
def test_every_key_round_trips_through_put_and_get(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str,
                                                   buckets: str | None, alloc: str | None, offload: bool) -> None:
    for name, value in (("AUTOTUNE_ATTENTION_BUCKETS", buckets), ("PYTORCH_ALLOC_CONF", alloc)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    techniques = frozenset({"bf16", "checkpointing"} | ({"offload"} if offload else set()))
    parts = key_parts(model=nn.Linear(4, 4), batch=torch.zeros(2, 4), global_batch_size=8, world_size=1,
                      placement=PLACEMENTS[kind], budget_bytes=2**30, techniques=techniques, margin=0.1,
                      host_budget_bytes=2**33 if offload else None)
    assert set(parts["runtime"]) <= set(RUNTIME_FIELDS)
    padded = buckets == "1" or (buckets is None and kind == "cuda" and torch.backends.cuda.cudnn_sdp_enabled())
    assert ("attention_multiple" in parts["runtime"]) == padded, "the padded length is part of the key where used"
    check_parts(parts)

    plan = _answering(parts, kind)
    cache = PlanCache(tmp_path / "plans.db")
    cache.put(plan, parts)
    served = cache.get(plan_key(parts))
    assert served is not None and served.micro_batch_size == plan.micro_batch_size

    cache.export(tmp_path / "team.jsonl")
    other = PlanCache(tmp_path / "other.db")
    report = other.import_(tmp_path / "team.jsonl")
    assert report.rejected == () and report.accepted == (plan_key(parts),)


def _answering(parts: dict, kind: str) -> Plan:
    """A sample plan made to answer `parts`: its key, device and budget."""
    template, _ = sample()
    d = set_plan_fields(template.to_dict(), key=plan_key(parts), device=kind, memory_budget_bytes=2**30)
    return Plan.from_dict(d)


def test_a_runtime_field_nobody_declared_is_still_refused() -> None:
    _, parts = sample()
    parts["runtime"]["something_new"] = 1
    with pytest.raises(ValueError, match="unknown field.*parts.runtime: something_new"):
        check_parts(parts)
    _, parts = sample()
    del parts["runtime"]["torch"]
    with pytest.raises(ValueError, match="missing field.*parts.runtime: torch"):
        check_parts(parts)


def test_fit_with_padded_attention_stores_its_plan_and_serves_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """What every GPU user with the default cache runs: padded attention on, a cache file, two `fit` calls."""
    monkeypatch.setenv("AUTOTUNE_ATTENTION_BUCKETS", "1")
    model, batch = tiny_workload()
    cache = tmp_path / "plans.db"
    tuned = fit(model, batch, cache)
    served = fit(model, batch, cache)
    assert (tuned.source, served.source) == ("tuned", "cache")
    assert served.micro_batch_size == tuned.micro_batch_size
