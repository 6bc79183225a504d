"""The plan cache: keys, concurrency, hits through the real `fit`, failures, sharing, and a broken database.

Everything here runs the real thing: real SQLite files, real processes, the real `autotune.fit` on a tiny
GPT under the simulated ceiling. A broken database is really broken: garbage bytes, damaged pages, a lock
held by another connection, a read-only directory (a read-only mount when running as root, which ignores
file modes), a page limit reached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import shutil
import sqlite3
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from cache_samples import TINY, cache_warnings, clean_environment, fit, sample, set_plan_fields, tiny_workload  # noqa: F401 - autouse fixture
from gpt import GPT, random_batch
from subprocess_env import with_path

from autotune.cache.db import SCHEMA_VERSION
from autotune.cache.lines import read_rows
from autotune.cache.store import (
    CacheError,
    CacheWarning,
    PlanCache,
    default_path,
    filesystem_type,
    is_network_filesystem,
    key_parts,
    open_cache,
    plan_key,
)
from autotune.devices.placement import Placement
from autotune.errors import InvalidSetting
from autotune.plan import PLAN_FORMAT_VERSION, Plan

WORKERS = 16
PLANS_PER_WORKER = 20


def trial_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(("autotune.search.controller", "autotune.search.trial",
                                                            "autotune.progress"))]


# -- the key ---------------------------------------------------------------------------------------------------

def parts_for(model: torch.nn.Module, batch: object, **changes: object) -> dict:
    settings = dict(model=model, batch=batch, global_batch_size=8, world_size=1,
                    placement=Placement(kind="cuda", name="NVIDIA H200", total_bytes=141 * 2**30),
                    budget_bytes=24 * 2**30, techniques=frozenset({"bf16", "checkpointing"}), margin=0.1)
    settings.update(changes)
    return key_parts(**settings)


def test_key_ignores_weight_values_but_sees_what_changes_memory() -> None:
    model, batch = tiny_workload()
    key = plan_key(parts_for(model, batch))
    torch.manual_seed(123)
    assert plan_key(parts_for(GPT(TINY), batch)) == key, "other weights, same structure: same key"
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # "training" changes values only
    assert plan_key(parts_for(model, batch)) == key
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert plan_key(parts_for(model, batch, optimizer=opt)) == key, "the default is AdamW; lr is not memory"

    more_heads = GPT(dataclasses.replace(TINY, n_head=4))  # same parameter shapes, 2x the attention scores
    longer = random_batch(dataclasses.replace(TINY, seq_len=8), 8)
    frozen = GPT(TINY)
    frozen.tok.weight.requires_grad_(False)
    different = [
        parts_for(more_heads, batch),
        parts_for(model, longer),
        parts_for(frozen, batch),
        parts_for(model, batch, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)),
        parts_for(model, batch, optimizer=torch.optim.AdamW(model.parameters(), amsgrad=True)),
        parts_for(model, batch, budget_bytes=16 * 2**30),
        parts_for(model, batch, margin=0.2),
        parts_for(model, batch, world_size=2, global_batch_size=8),
        parts_for(model, batch, techniques=frozenset({"bf16"})),
        parts_for(model, batch, max_micro_batch=4),
        parts_for(model, batch, loss_fn=lambda m, b: m(*b)),
        parts_for(model, batch, placement=Placement(kind="cuda", name="NVIDIA H100", total_bytes=80 * 2**30)),
    ]
    keys = [plan_key(p) for p in different]
    assert key not in keys and len(set(keys)) == len(keys)


def test_key_survives_a_json_round_trip() -> None:
    parts = parts_for(*tiny_workload())
    assert plan_key(json.loads(json.dumps(parts))) == plan_key(parts)


# -- concurrency -----------------------------------------------------------------------------------------------

def _worker(path: str, worker: int, samples: list, barrier: multiprocessing.synchronize.Barrier) -> None:
    try:
        warnings.simplefilter("error", CacheWarning)  # any degradation is a failure here
        mine = samples[worker * PLANS_PER_WORKER:(worker + 1) * PLANS_PER_WORKER]
        neighbour = samples[((worker + 1) % WORKERS) * PLANS_PER_WORKER:][:PLANS_PER_WORKER]
        barrier.wait()
        store = PlanCache(path, strict=True)  # strict: database trouble raises instead of degrading
        for (plan, parts), (other, _) in zip(mine, neighbour):
            store.put(plan, parts)
            if store.get(plan.key) != plan:
                raise AssertionError(f"read back a different plan for {plan.key[:12]}")
            store.mark_unsafe(plan.key, micro_batch_size=2 * plan.micro_batch_size, note=f"worker {worker}")
            if store.max_safe_micro_batch(plan.key) != 2 * plan.micro_batch_size - 1:
                raise AssertionError("lost a failure")
            store.get(other.key)  # there yet or not, written by another process this instant: no error either way
        store.entries()
    except BaseException:  # noqa: BLE001 - reported through the exit code, with the traceback
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    os._exit(0)


def test_sixteen_processes_write_and_read_one_cache_without_error_or_loss(tmp_path: Path) -> None:
    path = str(tmp_path / "plans.db")  # a new file: the processes also race to create it
    samples = [sample(i) for i in range(WORKERS * PLANS_PER_WORKER)]
    ctx = multiprocessing.get_context("fork")  # the children inherit the samples; nothing is pickled
    barrier = ctx.Barrier(WORKERS)
    procs = [ctx.Process(target=_worker, args=(path, w, samples, barrier)) for w in range(WORKERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * WORKERS

    entries = {e.key: e for e in PlanCache(path).entries()}
    assert len(entries) == WORKERS * PLANS_PER_WORKER
    for plan, _ in samples:
        entry = entries[plan.key]
        assert entry.plan == plan and entry.status == "safe"
        assert [f.micro_batch_size for f in entry.failures] == [2 * plan.micro_batch_size]


# -- through fit -----------------------------------------------------------------------------------------------

def test_cache_hit_returns_the_tuned_plan_without_running_a_trial(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    model, batch = tiny_workload()
    caplog.set_level(logging.INFO, logger="autotune")
    started = time.perf_counter()
    tuned = fit(model, batch, tmp_path / "plans.db")
    tune_seconds = time.perf_counter() - started
    assert tuned.source == "tuned" and tuned.trials and trial_records(caplog), "a tune runs (and logs) trials"
    caplog.clear()

    started = time.perf_counter()
    hit = fit(model, batch, tmp_path / "plans.db")
    seconds = time.perf_counter() - started

    assert hit.source == "cache"
    assert trial_records(caplog) == [], "a hit runs no trial"
    assert hit.with_provenance(source="tuned") == tuned  # trials and measurements included
    # A hit costs milliseconds, a tune seconds; a busy machine slows both, so the bound follows the tune's time.
    assert seconds < max(1.0, tune_seconds / 5), f"a hit took {seconds:.3f} s, the tune {tune_seconds:.3f} s"

    caplog.clear()
    again = fit(model, batch, tmp_path / "plans.db", retune=True)
    assert again.source == "tuned" and trial_records(caplog)


# What a new process's hit loads: the loss check runs the example under a dispatch mode (evaluation.py), whose
# handler torch would keep out of Dynamo by importing it, and the check reshards FSDP2 units, which an import of
# torch.distributed.fsdp would find; neither model is compiled or sharded, and each import costs over a second.
HIT_IN_A_NEW_PROCESS = """
import json, sys, time
import torch
from cache_samples import fit, tiny_workload
model, batch = tiny_workload()
started = time.perf_counter()
plan = fit(model, batch, sys.argv[1])
print(json.dumps({"source": plan.source, "seconds": time.perf_counter() - started,
                  "loaded": [m for m in ("torch._dynamo", "torch.distributed.fsdp") if m in sys.modules]}))
"""


@pytest.mark.slow  # a process of its own, which imports torch
def test_a_hit_in_a_new_process_loads_neither_dynamo_nor_fsdp(tmp_path: Path) -> None:
    model, batch = tiny_workload()
    assert fit(model, batch, tmp_path / "plans.db").source == "tuned"
    tests = os.path.dirname(os.path.abspath(__file__))
    env = with_path(tests, os.path.join(tests, "..", "examples"))
    done = subprocess.run([sys.executable, "-c", HIT_IN_A_NEW_PROCESS, str(tmp_path / "plans.db")], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    hit = json.loads(done.stdout.splitlines()[-1])
    assert hit["source"] == "cache" and hit["loaded"] == [], hit


@pytest.mark.slow  # seconds: searches that run real trial steps
def test_a_row_of_plan_format_1_is_retuned_and_never_misread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    # An older autotune (plan format 1: no compile, block count, offload fraction...) wrote this cache and
    # an export. Its rows are keyed on format 1, so this autotune's lookup misses and tunes again; its
    # export is refused row by row, naming the format.
    from autotune.cache import key as cache_key

    model, batch = tiny_workload()
    path = tmp_path / "plans.db"
    with monkeypatch.context() as older:
        older.setattr(cache_key, "PLAN_FORMAT_VERSION", 1)
        written = fit(model, batch, path)
        assert written.source == "tuned"
        assert PlanCache(path).export(tmp_path / "v1.jsonl") == 1
    caplog.set_level(logging.INFO, logger="autotune")
    caplog.clear()
    again = fit(model, batch, path)
    assert again.source == "tuned" and trial_records(caplog), "the format-1 row was served"
    assert fit(model, batch, path).source == "cache"  # the re-tuned plan is what is cached now
    report = PlanCache(tmp_path / "fresh.db").import_(tmp_path / "v1.jsonl")
    assert report.accepted == () and len(report.rejected) == 1
    assert f"parts.format is 1, this autotune reads {PLAN_FORMAT_VERSION}" in report.rejected[0][1]


# A plan as autotune wrote it before plans had parts (plan format 2: one flat record), with one trial.
FLAT_V2_PLAN = {
    "precision": "bf16", "checkpointing": "none", "offload": "none", "micro_batch_size": 4, "accumulation_steps": 2,
    "world_size": 1, "global_batch_size": 8, "last_micro_batch_size": 4, "peak_memory_bytes": 1000,
    "memory_budget_bytes": 67108864, "margin": 0.1, "samples_per_second": 80.0, "tokens_per_second": None,
    "device": "cpu", "device_name": "cpu (simulated ceiling)", "source": "tuned", "reason": "sample 0",
    "trials": [{"rung": {"precision": "bf16", "checkpointing": "none", "offload": "none", "checkpointed_blocks": 0,
                         "compile": False, "optimizer_8bit": False}, "micro_batch_size": 4, "outcome": "ok",
                "peak_bytes": 1000, "seconds": 0.5, "step_seconds": 0.1, "optimizer_seconds": 0.01,
                "samples_per_second": 80.0, "alloc_retries": 0, "compile_seconds": 0.0, "reduce_seconds": 0.0,
                "reduce_after_seconds": 0.0, "note": ""}],
    "key": "", "compile": False, "checkpointed_blocks": None, "compile_seconds": 0.0, "offload_fraction": 0.0,
    "offload_overlap": None, "sharding": "none", "reduce_overlap": None, "flops_per_sample": None, "mfu": None,
    "measured_samples_per_second": None, "min_micro_batch_size": 1, "techniques": None, "optimizer_8bit": False,
    "block_paths": [], "format_version": 2, "host_peak_bytes": None, "max_length": None,
}


@pytest.mark.slow  # seconds: starts processes that import torch
def test_a_flat_row_of_plan_format_2_is_listed_stale_and_retuned(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    # An older autotune wrote flat plans: one under its own key (parts of format 2), and one under the key this
    # autotune computes (as if only the plan had changed). Neither is misread: both list as stale, and fit
    # tunes again and stores a plan of this format in place of the second.
    from click.testing import CliRunner
    from sqlite_utils import Database

    from autotune.cli.main import main

    model, batch = tiny_workload()
    path = tmp_path / "plans.db"
    key = fit(model, batch, path).key
    with PlanCache(path) as store:
        (entry,) = store.entries()
        old_parts = {**entry.parts, "format": 2}
    old_key = plan_key(old_parts)
    db = Database(path)
    db["plans"].update(key, {"plan": json.dumps({**FLAT_V2_PLAN, "key": key})})
    db["plans"].insert({"key": old_key, "parts": json.dumps(old_parts), "origin": "tuned", "created": 1.0,
                        "updated": 1.0, "plan": json.dumps({**FLAT_V2_PLAN, "key": old_key})})
    db.close()

    listed = CliRunner().invoke(main, ["cache", "--cache", str(path), "list"], catch_exceptions=False)
    assert listed.exit_code == 0 and listed.output.count("stale: another plan format, tuned again") == 2, listed.output
    shown = CliRunner().invoke(main, ["cache", "--cache", str(path), "show", old_key[:12]], catch_exceptions=False)
    assert shown.exit_code == 0 and "written by another plan format" in shown.output, shown.output
    assert [e.status for e in PlanCache(path).entries()] == ["stale", "stale"]
    assert PlanCache(path).get(key) is None and PlanCache(path).export(tmp_path / "out.jsonl") == 0

    caplog.set_level(logging.INFO, logger="autotune")
    caplog.clear()
    again = fit(model, batch, path)
    assert again.source == "tuned" and trial_records(caplog), "the flat row was served"
    assert again.format_version == PLAN_FORMAT_VERSION and again.key == key
    assert {e.key: e.status for e in PlanCache(path).entries()} == {key: "safe", old_key: "stale"}
    assert fit(model, batch, path).source == "cache"


@pytest.mark.slow  # seconds: searches that run real trial steps
def test_an_oom_seen_in_training_makes_the_next_fit_choose_a_smaller_micro_batch(tmp_path: Path) -> None:
    model, batch = tiny_workload()
    store = PlanCache(tmp_path / "plans.db")
    first = fit(model, batch, store)
    assert first.micro_batch_size > 1, "the test needs room below the first plan"

    store.mark_unsafe(first.key, micro_batch_size=first.micro_batch_size, shapes={"[0]": [8, 16]},
                      note="CUDA out of memory")
    assert store.get(first.key) is None
    assert store.max_safe_micro_batch(first.key) == first.micro_batch_size - 1

    second = fit(model, batch, store)
    assert second.source == "tuned" and second.key == first.key
    assert second.micro_batch_size < first.micro_batch_size
    assert second.accumulation_steps > 1  # the global batch is kept
    assert store.get(first.key) == second, "the safer plan is cached"


def test_replace_keeps_the_parts_and_a_smaller_plan_is_safe_again(tmp_path: Path) -> None:
    store = PlanCache(tmp_path / "plans.db")
    plan, parts = sample(0, micro=8)
    store.put(plan, parts)
    store.mark_unsafe(plan.key, micro_batch_size=8)
    assert store.get(plan.key) is None
    smaller, _ = sample(0, micro=4)
    store.replace(plan.key, smaller)
    assert store.get(plan.key) == smaller
    (entry,) = store.entries()
    assert entry.parts == parts and entry.origin == "replaced" and entry.status == "safe"


def test_micro_batch_one_failing_still_bounds_at_one(tmp_path: Path) -> None:
    store = PlanCache(tmp_path / "plans.db")
    store.mark_unsafe("k" * 64, micro_batch_size=1)
    assert store.max_safe_micro_batch("k" * 64) == 1
    with pytest.raises(ValueError, match="positive integer"):
        store.mark_unsafe("k" * 64, micro_batch_size=0)


# -- sharing ---------------------------------------------------------------------------------------------------

def test_export_then_import_into_an_empty_cache_reproduces_the_plans(tmp_path: Path) -> None:
    source = PlanCache(tmp_path / "mine.db")
    for i in range(3):
        source.put(*sample(i))
    source.mark_unsafe(sample(1)[0].key, micro_batch_size=16, shapes={"x": torch.Size([16, 4])}, note="OOM")
    assert source.export(tmp_path / "plans.jsonl") == 3

    target = PlanCache(tmp_path / "theirs.db")
    report = target.import_(tmp_path / "plans.jsonl")
    assert report.rejected == () and len(report.accepted) == 3

    def contents(store: PlanCache) -> dict:
        return {e.key: (e.parts, e.plan, e.failures, e.updated) for e in store.entries()}

    assert contents(target) == contents(source)
    assert target.get(sample(2)[0].key) == sample(2)[0]
    assert target.import_(tmp_path / "plans.jsonl").rejected == ()  # importing twice changes nothing
    assert contents(target) == contents(source)


def tampered_export(tmp_path: Path) -> tuple[Path, str]:
    """An export of five plans, four of them tampered with, plus two lines that are not plan rows."""
    work = tmp_path / "tampering"
    work.mkdir()
    store = PlanCache(work / "plans.db")
    for i in range(5):
        store.put(*sample(i))
    store.export(work / "plans.jsonl")
    rows = [json.loads(line) for line in (work / "plans.jsonl").read_text().splitlines()]
    rows[0]["plan"]["speedup"] = 2.0  # unknown field
    set_plan_fields(rows[1]["plan"], micro_batch_size=-4)  # negative micro-batch
    rows[2]["key"] = rows[3]["key"]  # wrong key
    rows[3]["parts"]["budget_bytes"] *= 2  # parts and key agree, but the plan answers another budget
    rows[3]["key"] = rows[3]["plan"]["provenance"]["key"] = plan_key(rows[3]["parts"])
    lines = [json.dumps(r) for r in rows] + ["{not json", json.dumps({**rows[4], "pickle": "gASVAAAA"})]
    path = work / "tampered.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, rows[4]["key"]


def test_a_tampered_export_is_rejected_row_by_row(tmp_path: Path) -> None:
    path, good_key = tampered_export(tmp_path)
    target = PlanCache(tmp_path / "theirs.db")
    report = target.import_(path)
    assert report.accepted == (good_key,)
    reasons = dict(report.rejected)
    assert sorted(reasons) == [1, 2, 3, 4, 6, 7]
    assert "unknown Plan field(s): speedup" in reasons[1]
    assert "micro_batch_size must be a positive integer, got -4" in reasons[2]
    assert "does not match its parts" in reasons[3]
    assert "plan.memory_budget_bytes" in reasons[4]
    assert "not JSON" in reasons[6]
    assert "unknown field(s): pickle" in reasons[7]
    assert [e.key for e in target.entries()] == [good_key]


def test_a_team_directory_is_read_after_a_local_miss_and_never_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    model, batch = tiny_workload()
    alice = PlanCache(tmp_path / "alice.db")
    tuned = fit(model, batch, alice)
    team = tmp_path / "team"
    team.mkdir()
    alice.export(team / "alice.jsonl")
    bad, _ = tampered_export(tmp_path)
    shutil.copy(bad, team / "bob.jsonl")
    before = {p.name: p.stat().st_mtime_ns for p in team.iterdir()}

    monkeypatch.setenv("AUTOTUNE_TEAM_DIR", str(team))
    caplog.set_level(logging.INFO, logger="autotune")
    with cache_warnings() as caught:
        hit = fit(model, batch, tmp_path / "mine.db")
    assert hit.source == "cache" and trial_records(caplog) == []
    # Alice's plan, served once one trial of it fitted here (a teammate's plan is a claim until then).
    assert hit.trials[:-1] == tuned.trials and hit.findings == (*tuned.findings, hit.findings[-1])
    assert hit.findings[-1].kind == "verified"
    assert hit.findings[-1].figures == {"peak_bytes": hit.trials[-1].peak_bytes,
                                        "samples_per_second": hit.trials[-1].samples_per_second}
    assert hit.samples_per_second == hit.trials[-1].samples_per_second  # measured here, not Alice's figure
    assert hit.with_evidence(findings=tuned.findings, trials=tuned.trials, peak_memory_bytes=tuned.peak_memory_bytes,
                             samples_per_second=tuned.samples_per_second, tokens_per_second=tuned.tokens_per_second,
                             mfu=tuned.mfu).with_provenance(source="tuned") == tuned
    assert len(caught) == 1 and "bob.jsonl rejected" in str(caught[0].message)  # bob's bad rows, once
    assert PlanCache(tmp_path / "mine.db").entries() == []  # the team's plans are read, not copied
    assert {p.name: p.stat().st_mtime_ns for p in team.iterdir()} == before

    alice.mark_unsafe(tuned.key, micro_batch_size=tuned.micro_batch_size)
    alice.export(team / "alice.jsonl")
    mine = PlanCache(tmp_path / "mine.db")
    assert mine.get(tuned.key) is None, "a teammate's OOM counts too"
    assert mine.max_safe_micro_batch(tuned.key) == tuned.micro_batch_size - 1


# -- a broken database still yields a plan, with one warning -----------------------------------------------------

def fit_with_broken_cache(cache: Path | Callable[[], PlanCache]) -> tuple[Plan, list[warnings.WarningMessage]]:
    """`fit` with max_trials=2 (any plan will do), counting the cache's warnings from opening it on."""
    model, batch = tiny_workload()
    with cache_warnings() as caught:
        plan = fit(model, batch, cache if isinstance(cache, Path) else cache(), max_trials=2)
    return plan, caught


def test_a_corrupt_database_is_moved_aside_and_replaced(tmp_path: Path) -> None:
    # Garbage that is not SQLite at all may be anybody's file: test_faults.py checks it is left alone.
    path = tmp_path / "plans.db"
    with PlanCache(path) as store:
        for i in range(20):
            store.put(*sample(i))
    data = bytearray(path.read_bytes())
    data[4096:] = b"\xa5" * (len(data) - 4096)  # page 1 (header, schema) intact; every table page damaged
    path.write_bytes(bytes(data))
    damaged = path.read_bytes()

    plan, caught = fit_with_broken_cache(path)

    assert plan.source == "tuned"
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "moved it aside" in str(caught[0].message)
    (aside,) = tmp_path.glob("plans.db.corrupt-*")
    assert aside.read_bytes() == damaged
    assert PlanCache(path).get(plan.key) == plan, "a new cache was started and holds the plan"


@pytest.mark.parametrize("lock", ["writer", "exclusive"])
def test_a_locked_database_past_the_timeout_still_yields_a_plan(tmp_path: Path, lock: str) -> None:
    path = tmp_path / "plans.db"
    PlanCache(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    if lock == "exclusive":
        holder.execute("PRAGMA locking_mode = EXCLUSIVE")  # in WAL mode this shuts out readers too
    holder.execute("BEGIN EXCLUSIVE" if lock == "exclusive" else "BEGIN IMMEDIATE")
    holder.execute("INSERT INTO failures (key, micro_batch_size, time) VALUES ('x', 1, 0)")
    try:
        plan, caught = fit_with_broken_cache(lambda: PlanCache(path, timeout=0.2))
    finally:
        holder.rollback()
        holder.close()
    assert plan.source == "tuned"
    assert len(caught) == 1 and "busy timeout" in str(caught[0].message)


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """Make `directory` read-only: its mode for a normal user; for root, which ignores modes, a read-only mount."""
    if os.geteuid() != 0:
        directory.chmod(0o500)
        try:
            yield
        finally:
            directory.chmod(0o700)
        return
    saved = directory.with_name(directory.name + ".saved")
    shutil.copytree(directory, saved)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(directory)],
                      capture_output=True, check=False).returncode != 0:
        pytest.skip("running as root without the right to mount: no way to make a read-only directory")
    try:
        shutil.copytree(saved, directory, dirs_exist_ok=True)
        subprocess.run(["mount", "-o", "remount,ro", str(directory)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


@pytest.mark.parametrize("contents", ["empty", "with a cache"])
def test_a_read_only_directory_still_yields_a_plan(tmp_path: Path, contents: str) -> None:
    directory = tmp_path / "ro"
    directory.mkdir()
    if contents == "with a cache":
        with PlanCache(directory / "plans.db") as store:
            store.put(*sample(0))
    with read_only(directory):
        plan, caught = fit_with_broken_cache(directory / "plans.db")
    assert plan.source == "tuned"
    assert len(caught) == 1 and "cannot be written" in str(caught[0].message)
    assert "AUTOTUNE_CACHE" in str(caught[0].message)


def fill_to_page_limit(store: PlanCache) -> None:
    """Forbid the file to grow (`PRAGMA max_page_count`), then fill the room left in its pages."""
    db = store.database
    assert db is not None
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages}")
    with pytest.raises(sqlite3.OperationalError, match="full"):
        for i in range(100_000):
            db.execute("INSERT INTO plans (key, parts, plan) VALUES (?, '{}', '{}')", [f"padding-{i}"])


def test_a_full_database_still_yields_a_plan(tmp_path: Path) -> None:
    store = PlanCache(tmp_path / "plans.db")
    fill_to_page_limit(store)
    plan, caught = fit_with_broken_cache(lambda: store)
    assert plan.source == "tuned"
    assert len(caught) == 1 and "is full" in str(caught[0].message)
    assert "autotune cache clear" in str(caught[0].message)


def test_a_newer_schema_or_someone_elses_database_is_left_alone(tmp_path: Path) -> None:
    newer = tmp_path / "newer.db"
    PlanCache(newer).close()
    with contextlib.closing(sqlite3.connect(newer)) as conn:
        conn.execute("PRAGMA user_version = 99")
    plan, caught = fit_with_broken_cache(newer)
    assert plan.source == "tuned" and len(caught) == 1 and "newer autotune" in str(caught[0].message)

    foreign = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(foreign)) as conn:
        conn.execute("CREATE TABLE users (name TEXT)")
    plan, caught = fit_with_broken_cache(foreign)
    assert plan.source == "tuned" and len(caught) == 1 and "not an autotune plan cache" in str(caught[0].message)
    with contextlib.closing(sqlite3.connect(foreign)) as conn:
        assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["users"]
    with contextlib.closing(sqlite3.connect(newer)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 99

    with pytest.raises(CacheError, match="newer autotune. Upgrade autotune"):
        PlanCache(newer, strict=True)


def test_an_old_empty_file_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "plans.db"
    path.touch()  # schema version 0: nothing in it yet
    store = PlanCache(path)
    store.put(*sample(0))
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


# -- files and settings ----------------------------------------------------------------------------------------

def test_a_new_cache_is_private_to_its_user(tmp_path: Path) -> None:
    path = tmp_path / "a" / "autotune" / "plans.db"
    store = PlanCache(path)
    store.put(*sample(0))  # the -wal and -shm files exist while the cache is open
    assert path.parent.stat().st_mode & 0o777 == 0o700
    for name in ("plans.db", "plans.db-wal", "plans.db-shm"):
        assert (path.parent / name).stat().st_mode & 0o777 == 0o600, name
    mode = tmp_path.stat().st_mode & 0o777
    PlanCache(tmp_path / "other.db")
    assert tmp_path.stat().st_mode & 0o777 == mode, "an existing directory keeps its mode"


def test_default_path_follows_autotune_cache_then_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_path() == tmp_path / "xdg" / "autotune" / "plans.db"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert default_path() == Path.home() / ".cache" / "autotune" / "plans.db"
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "mine.db"))
    assert default_path() == tmp_path / "mine.db"
    assert open_cache(None).path == tmp_path / "mine.db"


def test_open_cache_settings(tmp_path: Path) -> None:
    store = PlanCache(tmp_path / "plans.db")
    assert open_cache(False) is None
    assert open_cache(store) is store
    assert open_cache(str(tmp_path / "x.db")).path == tmp_path / "x.db"
    with pytest.raises(InvalidSetting, match="cache=42: pass a path"):
        open_cache(42)


def test_network_file_systems_are_recognised(tmp_path: Path) -> None:
    mounts = [("/", "ext4"), (str(tmp_path), "nfs4"), (str(tmp_path / "sub"), "fuse.sshfs")]
    (tmp_path / "sub").mkdir()
    assert filesystem_type(tmp_path / "cache" / "plans.db", mounts) == "nfs4"  # need not exist yet
    assert filesystem_type(tmp_path / "sub" / "plans.db", mounts) == "fuse.sshfs"
    assert filesystem_type("/etc/hostname", mounts) == "ext4"
    for fstype in ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "fuse", "fuse.sshfs", "fuse.gcsfuse"):
        assert is_network_filesystem(fstype), fstype
    for fstype in ("ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "apfs", ""):
        assert not is_network_filesystem(fstype), fstype
    assert not is_network_filesystem(filesystem_type(tmp_path)), "this machine's temp dir is local"


def test_export_writes_rows_that_validate(tmp_path: Path) -> None:
    store = PlanCache(tmp_path / "plans.db")
    store.put(*sample(0))
    store.export(tmp_path / "out.jsonl")
    (result,) = list(read_rows(tmp_path / "out.jsonl"))
    assert result[1] is not None and result[2] == ""
    assert json.loads((tmp_path / "out.jsonl").read_text())["schema"] == 1
