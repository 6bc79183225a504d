"""Plan-cache faults a user meets: a blank key to `cache delete`, a retune after the clock stepped back, a cache
path that is a dangling symlink, and a teammate's row whose precision or throughput is not what this device gives.

Real SQLite files, the real CLI through click's runner, and the real `autotune.fit` on a tiny GPT on the CPU.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from cache_samples import GLOBAL_BATCH, TINY, clean_environment, fit, sample, set_plan_fields, tiny_workload  # noqa: F401
from click.testing import CliRunner

from autotune.cache.store import PlanCache
from autotune.cli.main import main
from autotune.evidence import Trial
from autotune.plan import Plan


def cli(*args: str) -> click.testing.Result:
    return CliRunner().invoke(main, ["cache", *args], catch_exceptions=False)


# -- `autotune cache delete` with a blank key ---------------------------------------------------------------------

@pytest.mark.parametrize("plans", [1, 2])
@pytest.mark.parametrize("key", ["", "   "])
def test_delete_refuses_a_blank_key_whatever_the_cache_holds(tmp_path: Path, plans: int, key: str) -> None:
    path = tmp_path / "plans.db"
    with PlanCache(path) as store:
        for i in range(plans):
            store.put(*sample(i))
    result = cli("--cache", str(path), "delete", key)
    assert result.exit_code == 2, result.output  # a usage error, before the cache is touched
    assert "is blank" in result.output and "autotune cache list" in result.output
    assert "autotune cache clear" in result.output
    assert len(PlanCache(path).entries()) == plans, "nothing was deleted"
    assert cli("--cache", str(path), "delete", sample(0)[0].key[:10]).exit_code == 0  # a real prefix still works


# -- a retune after the clock stepped back --------------------------------------------------------------------------

def dated(path: Path, seconds: float) -> None:
    """Date every stored plan of the cache file at `path` `seconds` from now, as a clock later stepped back left it."""
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE plans SET updated = ?", (time.time() + seconds,))


def test_a_new_plan_replaces_a_stored_one_dated_a_little_in_the_future(tmp_path: Path) -> None:
    path = tmp_path / "plans.db"
    first, parts = sample(0, micro=4)
    second, _ = sample(0, micro=2)
    with PlanCache(path) as store:
        store.put(first, parts)
    dated(path, 30.0)
    with PlanCache(path) as store:
        store.put(second, parts)
        hit = store.get(second.key)
    assert hit is not None and hit.micro_batch_size == 2, "the new plan was stored"


def test_retune_stores_its_plan_over_a_row_dated_a_little_in_the_future(tmp_path: Path) -> None:
    path = tmp_path / "plans.db"
    model, batch = tiny_workload()
    plan = fit(model, batch, path, max_trials=2)
    dated(path, 30.0)
    retuned = fit(model, batch, path, max_trials=2, retune=True)
    assert retuned.source == "tuned"
    (entry,) = PlanCache(path).entries()
    assert entry.key == plan.key and entry.updated <= time.time(), "the retuned plan replaced the stored one"


# -- a cache path that is a dangling symlink ------------------------------------------------------------------------

@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, under which a file made with default modes is 0644."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.usefixtures("umask_022")
@pytest.mark.parametrize("where", ["plans.db", "made/for/it/plans.db"])
def test_a_cache_path_that_is_a_dangling_symlink_gets_a_private_file(tmp_path: Path, where: str) -> None:
    target = tmp_path / "real" / where
    (tmp_path / "real").mkdir()
    link = tmp_path / "link.db"
    link.symlink_to(target)
    with PlanCache(link, strict=True) as store:
        store.put(*sample(0))
    assert link.is_symlink() and target.is_file(), "the file is made where the link points"
    assert mode(target) == 0o600
    made = [p for p in target.parents if tmp_path / "real" in p.parents]
    assert [mode(d) for d in made] == [0o700] * len(made)  # the directories made for it (none for plans.db)
    assert mode(tmp_path / "real") == 0o755, "an existing directory keeps its owner's mode"
    assert PlanCache(link).get(sample(0)[0].key) is not None


# -- a teammate's row: the precision this device trains in, and the throughput measured here -----------------------

CLAIMED = 1e9  # samples/s no tiny GPT on a CPU gives


@pytest.fixture(scope="module")
def alice(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Alice's plan for the tiny GPT with the default techniques (bf16 on the CPU), as a row of her export."""
    where = tmp_path_factory.mktemp("alice")
    with pytest.MonkeyPatch.context() as env:
        for name in ("AUTOTUNE_CACHE", "AUTOTUNE_TEAM_DIR", "AUTOTUNE_RETUNE", "AUTOTUNE_MAX_MICRO_BATCH"):
            env.delenv(name, raising=False)
        with PlanCache(where / "alice.db") as cache:
            model, batch = tiny_workload()
            fit(model, batch, cache, max_trials=2)
            cache.export(where / "alice.jsonl")
    (row,) = [json.loads(line) for line in (where / "alice.jsonl").read_text().splitlines()]
    assert row["plan"]["config"]["rung"]["precision"] == "bf16" and "bf16" in row["parts"]["techniques"]
    return row


def edited(row: dict, **plan: object) -> dict:
    """A copy of `row` with the plan fields changed (the key still matches: its parts are untouched)."""
    row = json.loads(json.dumps(row))
    set_plan_fields(row["plan"], **plan)
    return row


def bragging(row: dict) -> dict:
    """`row` claiming a throughput, an MFU and a real run's rate far beyond what this machine measures."""
    return edited(row, samples_per_second=CLAIMED, tokens_per_second=CLAIMED * TINY.seq_len, mfu=0.9,
                  measured_samples_per_second=CLAIMED)


def team_of(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row: dict) -> Path:
    team = tmp_path / "team"
    team.mkdir()
    (team / "alice.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.setenv("AUTOTUNE_TEAM_DIR", str(team))
    return team


def imported(tmp_path: Path, row: dict) -> Path:
    """Bob's cache with `row` imported through `autotune cache import`."""
    path, rows = tmp_path / "bob.db", tmp_path / "alice.jsonl"
    rows.write_text(json.dumps(row) + "\n")
    assert cli("--cache", str(path), "import", str(rows)).exit_code == 0
    return path


def bob_fits(cache: Path, caplog: pytest.LogCaptureFixture) -> tuple[Plan, list[str]]:
    """Bob's `fit` of Alice's workload, and the warnings autotune logged."""
    caplog.clear()
    caplog.set_level(logging.INFO, logger="autotune")
    model, batch = tiny_workload()
    plan = fit(model, batch, cache, max_trials=2)
    return plan, [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_team_row_in_fp16_is_refused_on_a_device_with_bf16(
        alice: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    team = team_of(tmp_path, monkeypatch, edited(alice, precision="fp16"))
    plan, warned = bob_fits(tmp_path / "bob.db", caplog)
    assert plan.source == "tuned" and plan.precision == "bf16"
    assert any(f"from team:{team}" in m and "plan trains in fp16, and a search on this device picks bf16" in m
               for m in warned), warned


def test_an_imported_row_in_fp16_is_refused_and_replaced_by_the_retune(
        alice: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = imported(tmp_path, edited(alice, precision="fp16"))
    plan, warned = bob_fits(path, caplog)
    assert plan.source == "tuned" and plan.precision == "bf16"
    assert any("from import:alice.jsonl" in m and "plan trains in fp16" in m for m in warned), warned
    (entry,) = PlanCache(path).entries()
    assert entry.origin == "tuned" and entry.plan is not None and entry.plan.precision == "bf16"


def assert_measured_here(plan: Plan) -> None:
    """`plan` carries the figures its verification trial measured, none of the row's claims."""
    trial = plan.trials[-1]
    assert plan.source == "cache" and trial.fits
    assert "1,000,000,000" not in plan.summary() and "a real run" not in plan.summary(), plan.summary()
    assert plan.samples_per_second == trial.samples_per_second < CLAIMED
    assert plan.tokens_per_second == pytest.approx(trial.samples_per_second * TINY.seq_len)
    assert plan.mfu is None and plan.measured_samples_per_second is None  # no peak for the CPU; no run here
    assert f"{trial.samples_per_second:,.1f} samples/s measured here" in plan.reason


def test_a_verified_team_row_is_served_with_the_throughput_measured_here(
        alice: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    team_of(tmp_path, monkeypatch, bragging(alice))
    plan, warned = bob_fits(tmp_path / "bob.db", caplog)
    assert warned == []
    assert_measured_here(plan)
    assert PlanCache(tmp_path / "bob.db").entries() == []  # the team's plan is verified, not copied


def test_a_verified_overlapped_plan_that_accumulates_is_rated_as_training_steps(
        alice: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A teammate's plan that overlaps optimizer offload at 2 x 4: training hides the host step in the last
    micro-step's backward only, so the rate measured here times the three before it serially (a serial trial
    beside the overlapped one); the overlapped trial alone would charge the host step to all four."""
    from autotune.search import tune

    seen: list[tuple[bool, Trial]] = []

    class Seen(tune.TrialRunner):  # the real trials, each recorded
        def __call__(self, *args: object, **kwargs: object) -> Trial:
            trial = super().__call__(*args, **kwargs)  # type: ignore[arg-type]
            seen.append((bool(kwargs.get("overlap")), trial))
            return trial

    monkeypatch.setattr(tune, "TrialRunner", Seen)
    row = edited(bragging(alice), offload="optimizer", offload_fraction=1.0, offload_overlap=True,
                 micro_batch_size=2, accumulation_steps=4, last_micro_batch_size=2)
    team_of(tmp_path, monkeypatch, row)
    plan, warned = bob_fits(tmp_path / "bob.db", caplog)
    assert plan.source == "cache" and warned == [], (plan.source, warned)
    assert sorted(overlap for overlap, _ in seen) == [False, True], seen
    serial, last = (next(t for overlap, t in seen if overlap is want) for want in (False, True))
    seconds = 3 * serial.step_seconds + last.step_seconds + last.optimizer_seconds
    assert plan.samples_per_second == pytest.approx(GLOBAL_BATCH / seconds, rel=1e-9)
    assert plan.samples_per_second != pytest.approx(last.samples_per_second, rel=1e-6)


def test_a_verified_imported_row_is_stored_with_the_throughput_measured_here(
        alice: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = imported(tmp_path, bragging(alice))
    plan, _ = bob_fits(path, caplog)
    assert_measured_here(plan)
    (entry,) = PlanCache(path).entries()
    assert entry.origin == "verified" and entry.plan == plan.with_provenance(source=entry.plan.source)
    (listed,) = json.loads(cli("--cache", str(path), "list", "--json").output)
    assert listed["plan"]["evidence"]["samples_per_second"] == plan.samples_per_second
    table = cli("--cache", str(path), "list").output
    assert "tokens/s" in table and "16.0B tokens/s" not in table, table  # the claim would print as 16.0B
    again, _ = bob_fits(path, caplog)  # measured here now: served as stored, with no second trial
    assert again.source == "cache" and again.trials == plan.trials
