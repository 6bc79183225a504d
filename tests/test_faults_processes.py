"""The fault table's scenarios of processes and signals: Ctrl-C inside `fit`'s trials, 16 `fit` calls
in 16 processes at once, concurrent `autotune cache import`, DataLoader workers forked after `fit`, and a plan
cached under another torch version.

Real processes (forked, so torch is imported once), a real SIGINT, real SQLite files, the real `fit` on a tiny
GPT under the simulated ceiling and the real CLI.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sqlite3
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_samples import BUDGET, GLOBAL_BATCH, fit, sample, tiny_workload
from click.testing import CliRunner

import autotune
from autotune.cache.key import plan_key
from autotune.cache.rows import PlanRow
from autotune.cache.store import CacheWarning, PlanCache
from autotune.cli.main import main

FORK = multiprocessing.get_context("fork")  # children inherit the workload; nothing is pickled
JOIN_TIMEOUT = 240  # seconds for a child on two busy CPUs


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AUTOTUNE_CACHE", "AUTOTUNE_TEAM_DIR", "AUTOTUNE_RETUNE", "AUTOTUNE_MAX_MICRO_BATCH"):
        monkeypatch.delenv(name, raising=False)


def run_children(target: Any, count: int, *args: Any) -> list[int | None]:
    """Start `count` forked children `target(i, barrier, *args)` that meet at a barrier; their exit codes."""
    barrier = FORK.Barrier(count)
    children = [FORK.Process(target=_guarded, args=(target, i, barrier, *args)) for i in range(count)]
    for child in children:
        child.start()
    deadline = time.monotonic() + JOIN_TIMEOUT  # one deadline for all: a hang costs minutes, not 16 x minutes
    for child in children:
        child.join(timeout=max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.is_alive():
            child.kill()  # a hung child would otherwise hold the suite (and CI) forever
            child.join()
    return [child.exitcode for child in children]


def _guarded(target: Any, *args: Any) -> None:
    # A forked child must not enter an OpenMP parallel region: GNU libgomp's thread pool does not survive
    # fork, and the child hangs on its first multi-threaded op (seen under CI's default thread count: all 16
    # children asleep on a futex for 17 minutes). One thread keeps every op inline, as DataLoader workers do.
    torch.set_num_threads(1)
    try:
        warnings.simplefilter("error", CacheWarning)  # any degradation of the cache fails the child
        target(*args)
    except BaseException:  # noqa: BLE001 - reported through the exit code, with the traceback
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


# -- Ctrl-C during fit's trials, nothing cached yet -------------------------------------------------------------

class InterruptedAt(torch.nn.Module):
    """The tiny GPT; its `at`-th forward sends this process a real SIGINT, as Ctrl-C in the terminal would."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.gpt, _ = tiny_workload()
        self.at, self.calls = at, 0

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            os.kill(os.getpid(), signal.SIGINT)
        return self.gpt(idx, targets)


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt in this test, as in a terminal, whatever the harness set: a test run
    started in the background by a non-interactive shell inherits SIGINT ignored (seen: .ci/run launched
    from a script with `&` failed here on the handler, not on fit)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_the_trials_stops_fit_restores_the_model_and_caches_nothing(tmp_path: Path,
                                                                                  ctrl_c_raises) -> None:
    model = InterruptedAt(at=4)  # the FLOP count runs one forward; the first trial's later steps are interrupted
    _, batch = tiny_workload()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    cache = tmp_path / "plans.db"
    with pytest.raises(KeyboardInterrupt):
        fit(model, batch, cache, optimizer=optimizer)
    assert model.calls >= 4, "interrupted inside the trials"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert torch.equal(torch.get_rng_state(), rng) and optimizer.state_dict()["state"] == {}
    assert all(p.grad is None and p.dtype == torch.float32 for p in model.parameters())
    with PlanCache(cache, strict=True) as store:
        assert store.entries() == [] and store.database is not None
        assert store.database.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    model.at = 0  # no more interruptions: the next fit tunes as if nothing had happened
    assert fit(model, batch, cache, optimizer=optimizer, max_trials=2).source == "tuned"


# -- 16 fit calls in 16 processes at once ---------------------------------------------------------------------

def _fit_child(i: int, barrier: Any, cache: str, results: str) -> None:
    model, batch = tiny_workload()
    barrier.wait()
    plan = autotune.fit(model, batch, global_batch_size=GLOBAL_BATCH, device="cpu", memory_budget=BUDGET, cache=cache,
                        trial_steps=1, max_trials=1)  # as short as a search gets: 16 of them share two CPUs
    Path(results, f"{i}.json").write_text(json.dumps({"source": plan.source, "key": plan.key}))


@pytest.mark.slow  # sixteen forked processes, each a fit, on two cores
def test_sixteen_fit_calls_in_sixteen_processes_share_one_new_cache(tmp_path: Path) -> None:
    cache, results = tmp_path / "plans.db", tmp_path / "results"
    results.mkdir()
    fit(*tiny_workload(), False, max_trials=1)  # the first fit imports torch's optimizer stack: once, before forking
    assert run_children(_fit_child, 16, str(cache), str(results)) == [0] * 16
    found = [json.loads(p.read_text()) for p in results.iterdir()]
    assert len(found) == 16 and len({r["key"] for r in found}) == 1
    assert all(r["source"] in ("tuned", "cache") for r in found)
    [entry] = PlanCache(cache, strict=True).entries()
    assert entry.key == found[0]["key"] and entry.failures == ()
    model, batch = tiny_workload()
    assert fit(model, batch, cache, max_trials=2).source == "cache"


# -- concurrent `autotune cache import` -----------------------------------------------------------------------

BUNDLES, ROWS_PER_BUNDLE = 8, 4


def _import_child(i: int, barrier: Any, cache: str, bundles: str) -> None:
    barrier.wait()
    result = CliRunner().invoke(main, ["cache", "--cache", cache, "import", str(Path(bundles, f"{i}.jsonl"))])
    if result.exit_code != 0 or f"imported {ROWS_PER_BUNDLE + 1} plan(s)" not in result.output:
        raise AssertionError(f"import {i} exited {result.exit_code}: {result.output}")


def test_concurrent_cache_imports_into_one_file_lose_no_row(tmp_path: Path) -> None:
    bundles = tmp_path / "bundles"
    bundles.mkdir()
    shared = sample(999)  # every bundle also holds this row: the same key imported 8 times at once
    for b in range(BUNDLES):
        rows = [sample(b * ROWS_PER_BUNDLE + r) for r in range(ROWS_PER_BUNDLE)] + [shared]
        (bundles / f"{b}.jsonl").write_text("".join(
            PlanRow(key=plan.key, parts=parts, plan=plan, updated=1.0).to_json() + "\n" for plan, parts in rows))
    cache = tmp_path / "plans.db"
    assert run_children(_import_child, BUNDLES, str(cache), str(bundles)) == [0] * BUNDLES
    keys = {e.key for e in PlanCache(cache, strict=True).entries()}
    assert keys == {sample(i)[0].key for i in range(BUNDLES * ROWS_PER_BUNDLE)} | {shared[0].key}


# -- DataLoader workers forked after fit -----------------------------------------------------------------------

class Samples(torch.utils.data.Dataset):
    """Each item also looks the plan up in the cache the parent opened: a forked worker must use its own
    connection, never the parent's."""

    def __init__(self, batch: tuple[torch.Tensor, torch.Tensor], store: PlanCache, key: str) -> None:
        self.batch, self.store, self.key = batch, store, key

    def __len__(self) -> int:
        return 4 * GLOBAL_BATCH

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        idx, targets = self.batch
        found = self.store.get(self.key) is not None
        return idx[i % GLOBAL_BATCH], targets[i % GLOBAL_BATCH], found


def test_dataloader_workers_forked_after_fit_train_and_leave_the_cache_intact(tmp_path: Path) -> None:
    model, batch = tiny_workload()
    store = PlanCache(tmp_path / "plans.db", strict=True)  # the user's, held open across the fork
    plan = fit(model, batch, store, max_trials=2)  # any plan will do: the workers forked after it are what is tested
    step = plan.apply(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = torch.utils.data.DataLoader(Samples(batch, store, plan.key), batch_size=GLOBAL_BATCH, num_workers=2,
                                         multiprocessing_context="fork")
    losses, found = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        for idx, targets, hit in loader:
            losses.append(step((idx, targets)))
            found.extend(hit.tolist())
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert found == [True] * len(found), "every worker read the plan through its own connection"
    assert store.get(plan.key) is not None  # the parent's connection still works after its workers exited
    with sqlite3.connect(store.path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


# -- a plan cached under another torch version ------------------------------------------------------------------

def test_a_plan_cached_under_another_torch_version_is_never_served(tmp_path: Path) -> None:
    model, batch = tiny_workload()
    theirs = PlanCache(tmp_path / "theirs.db")
    fit(model, batch, theirs, max_trials=2)  # a short search: which plan is cached does not matter here
    theirs.export(tmp_path / "bundle.jsonl")
    row = json.loads((tmp_path / "bundle.jsonl").read_text())
    row["parts"]["runtime"]["torch"] = "2.4.0"  # the teammate's torch: an honest row, for another runtime
    row["key"] = row["plan"]["provenance"]["key"] = plan_key(row["parts"])
    (tmp_path / "stale.jsonl").write_text(json.dumps(row) + "\n")
    mine = tmp_path / "mine.db"
    result = CliRunner().invoke(main, ["cache", "--cache", str(mine), "import", str(tmp_path / "stale.jsonl")])
    assert result.exit_code == 0 and "imported 1 plan(s)" in result.output, result.output

    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        plan = fit(model, batch, mine, max_trials=2)
    assert plan.source == "tuned" and plan.key != row["key"]
    assert {e.key for e in PlanCache(mine).entries()} == {row["key"], plan.key}  # the stale row is kept, unused
