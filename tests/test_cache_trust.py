"""A teammate's plan is a claim: rows from a team directory or an import are checked before they are trusted.

Real SQLite files, real exports and team directories, and the real `autotune.fit` on a tiny GPT on the CPU
under a simulated budget. Alice tunes and exports; a row of her export is then poisoned (a 1-byte peak, a
precision or technique its key does not allow, a date in the future, terminal escapes, a global batch of
10^12) and Bob's import or `fit` must refuse it, verify it with a trial, or escape it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from cache_samples import (  # noqa: F401
    BUDGET,
    GLOBAL_BATCH,
    cache_warnings,
    clean_environment,
    sample,
    set_plan_fields,
    tiny_workload,
)
from click.testing import CliRunner

import autotune
from autotune.cache.key import plan_key
from autotune.cache.rows import NothingFits, PlanRow
from autotune.cache.store import PlanCache
from autotune.cli.main import main

SMALL = "1MiB"  # the tiny GPT fits at micro-batch 4 in FP32 here, not at 8
ESCAPES = "\x1b[2J\x1b]0;owned\x07"  # clear the screen, retitle the terminal, bell
YEAR = 365 * 24 * 3600.0
YEAR_3000 = 32503680000.0  # 3000-01-01 in seconds since the epoch


def fit(cache: Path | PlanCache, **settings: Any) -> autotune.Plan:
    """The real `fit` of the tiny GPT in FP32 (techniques=()) on the CPU under a simulated budget."""
    model, batch = tiny_workload()
    settings = {"memory_budget": BUDGET, **settings}
    return autotune.fit(model, batch, global_batch_size=GLOBAL_BATCH, device="cpu", cache=cache, trial_steps=1,
                        techniques=(), **settings)


@pytest.fixture(scope="module")
def alice(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Alice's plan for the tiny GPT under the roomy budget (FP32; two trials), as a row of her export."""
    where = tmp_path_factory.mktemp("alice")
    with pytest.MonkeyPatch.context() as env:
        for name in ("AUTOTUNE_TEAM_DIR", "AUTOTUNE_RETUNE", "AUTOTUNE_MAX_MICRO_BATCH"):
            env.delenv(name, raising=False)
        cache = PlanCache(where / "alice.db")
        fit(cache, max_trials=2)
    cache.export(where / "alice.jsonl")
    (row,) = [json.loads(line) for line in (where / "alice.jsonl").read_text().splitlines()]
    return row


def rekeyed(row: dict, **plan: Any) -> dict:
    """`row` with the plan fields changed and its key recomputed from its parts, as a careful forger would."""
    row = json.loads(json.dumps(row))
    set_plan_fields(row["plan"], **plan)
    row["key"] = row["plan"]["provenance"]["key"] = plan_key(row["parts"])
    return row


def whole_batch_at(row: dict, budget: int) -> dict:
    """`row` claiming that the whole batch in one micro-batch of 8 (over 1 MiB in FP32) fits under `budget`."""
    row = json.loads(json.dumps(row))
    row["parts"]["budget_bytes"] = budget
    return rekeyed(row, memory_budget_bytes=budget, micro_batch_size=8, accumulation_steps=1, last_micro_batch_size=8)


def team_of(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *rows: dict) -> Path:
    team = tmp_path / "team"
    team.mkdir(exist_ok=True)
    (team / "alice.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("AUTOTUNE_TEAM_DIR", str(team))
    return team


def huge_row() -> dict:
    """A valid-looking row for a global batch of 10^12 samples at micro-batch 4 (key recomputed)."""
    plan, parts = sample(0)
    row = json.loads(PlanRow(key=plan.key, parts=parts, plan=plan, updated=time.time()).to_json())
    row["parts"]["global_batch_size"] = 10**12
    return rekeyed(row, global_batch_size=10**12, accumulation_steps=10**12 // 4, last_micro_batch_size=4)


def bob_fits(tmp_path: Path, **settings: Any) -> autotune.Plan:
    """Bob's `fit` of the same workload with a cache of his own; any plan a search finds in two trials will do."""
    return fit(tmp_path / "bob.db", max_trials=2, **settings)


# -- the numbers must be ones a measurement could give --------------------------------------------------------

def test_a_team_row_claiming_a_one_byte_peak_is_never_served(
        alice: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    row = whole_batch_at(alice, 2**20)
    team_of(tmp_path, monkeypatch, rekeyed(row, peak_memory_bytes=1))
    with cache_warnings() as caught:
        plan = bob_fits(tmp_path, memory_budget=SMALL)
    assert plan.source == "tuned" and plan.micro_batch_size < 8 and plan.peak_memory_bytes > 1
    (warning,) = [str(w.message) for w in caught]
    assert "plan.peak_memory_bytes 1 is under" in warning and "alice.jsonl" in warning


def test_a_team_plan_that_does_not_fit_here_is_tried_marked_unsafe_and_tuned_again(
        alice: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # A plausible peak, but micro-batch 8 needs more than the 1 MiB budget the row claims it fits.
    row = rekeyed(whole_batch_at(alice, 2**20), peak_memory_bytes=700_000)
    team = team_of(tmp_path, monkeypatch, row)
    caplog.set_level(logging.INFO, logger="autotune")
    plan = bob_fits(tmp_path, memory_budget=SMALL)
    assert plan.source == "tuned" and plan.micro_batch_size < 8
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"from team:{team}" in m and "did not fit in a trial here" in m for m in warned), warned
    assert PlanCache(tmp_path / "bob.db").max_safe_micro_batch(row["key"]) == 7  # the trial's OOM is recorded


def test_a_team_plan_that_fits_is_verified_by_one_trial_and_a_huge_row_beside_it_is_refused(
        alice: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    row = json.loads(json.dumps(alice))
    team = team_of(tmp_path, monkeypatch, huge_row(), row)
    with cache_warnings() as caught:
        plan = bob_fits(tmp_path)
    assert plan.source == "cache" and plan.micro_batch_size == row["plan"]["config"]["micro_batch_size"]
    assert len(plan.trials) == len(row["plan"]["evidence"]["trials"]) + 1 and plan.trials[-1].fits
    assert f"verified here by one trial (a plan from team:{team}" in plan.reason
    assert plan.peak_memory_bytes == plan.trials[-1].peak_bytes
    (warning,) = [str(w.message) for w in caught]  # the file's other row is refused, in one line
    assert "(line 1: plan splits a global batch of 1,000,000,000,000 over 1 rank(s)" in warning
    assert "\n" not in warning
    assert PlanCache(tmp_path / "bob.db").entries() == []  # the team's plan is verified, not copied


# -- the configuration must be one the key allows ---------------------------------------------------------------

def test_a_team_row_in_bf16_is_never_served_to_a_fit_without_bf16(
        alice: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    row = json.loads(json.dumps(alice))
    assert row["parts"]["techniques"] == [] and row["plan"]["config"]["rung"]["precision"] == "fp32"
    team_of(tmp_path, monkeypatch, rekeyed(row, precision="bf16"))
    with cache_warnings() as caught:
        plan = bob_fits(tmp_path)
    assert plan.source == "tuned" and plan.precision == "fp32"
    (warning,) = [str(w.message) for w in caught]
    assert "plan uses bf16 precision, which its key parts do not allow" in warning


@pytest.mark.parametrize(("change", "reason"), [
    ({"precision": "bf16"}, "plan uses bf16 precision"),
    ({"precision": "fp16"}, "plan uses fp16 precision"),
    ({"compile": True}, "plan uses compile"),
    ({"optimizer_8bit": True}, "plan uses 8-bit optimizer state"),
    ({"techniques": ["bf16", "compile"]}, "plan.techniques name bf16, compile"),
    ({"micro_batch_size": 16, "accumulation_steps": 1, "last_micro_batch_size": 8},
     "plan.micro_batch_size 16 is over the per-rank batch 8"),
])
def test_an_import_refuses_a_configuration_its_key_does_not_allow(tmp_path: Path, change: dict, reason: str) -> None:
    plan, parts = sample(0)
    parts = {**parts, "techniques": []}
    good = json.loads(PlanRow(key=plan_key(parts), parts=parts, plan=plan, updated=1.0).to_json())
    good = rekeyed(good, precision="fp32")
    bad = rekeyed(good, **change)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(bad) + "\n")
    report = PlanCache(tmp_path / "bob.db").import_(path)
    assert report.accepted == () and len(report.rejected) == 1
    assert reason in report.rejected[0][1]
    path.write_text(json.dumps(good) + "\n")  # the control: the row as it was imports
    assert PlanCache(tmp_path / "bob.db").import_(path).accepted == (good["key"],)


# -- dates and text from elsewhere ------------------------------------------------------------------------------

def test_an_imported_row_dated_in_the_future_is_clamped_and_replaced_by_a_retune(alice: dict, tmp_path: Path) -> None:
    row = json.loads(json.dumps(alice))
    row["updated"] = time.time() + 100 * YEAR
    path = tmp_path / "future.jsonl"
    path.write_text(json.dumps(row) + "\n")
    bob = PlanCache(tmp_path / "bob.db")
    assert bob.import_(path).accepted == (row["key"],)
    (entry,) = bob.entries()
    assert entry.updated <= time.time() and entry.origin == "import:future.jsonl"
    plan = bob_fits(tmp_path, retune=True)
    assert plan.source == "tuned"
    (entry,) = PlanCache(tmp_path / "bob.db").entries()
    assert entry.origin == "tuned", "the retuned plan replaced the imported one"


def dated(path: Path, table: str, column: str, when: float) -> None:
    """Set every row's date in `table` of the cache file at `path`, as an import that kept its file's dates did."""
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute(f"UPDATE {table} SET {column} = ?", (when,))


def test_a_stored_plan_dated_in_the_future_is_replaced_by_a_retune(alice: dict, tmp_path: Path) -> None:
    path = tmp_path / "alice.jsonl"
    path.write_text(json.dumps(alice) + "\n")
    with PlanCache(tmp_path / "bob.db") as bob:
        assert bob.import_(path).accepted == (alice["key"],)
    dated(tmp_path / "bob.db", "plans", "updated", YEAR_3000)
    plan = bob_fits(tmp_path, retune=True)
    assert plan.source == "tuned"
    (entry,) = PlanCache(tmp_path / "bob.db").entries()
    assert entry.origin == "tuned" and entry.updated <= time.time(), "the retuned plan replaced the stored one"


def test_a_stored_refusal_dated_in_the_future_is_replaced_by_a_newer_import(tmp_path: Path) -> None:
    _, parts = sample(0)
    with PlanCache(tmp_path / "bob.db") as bob:
        key = bob.record_nothing_fits(parts, "an old search")
    dated(tmp_path / "bob.db", "nothing_fits", "time", YEAR_3000)
    path = tmp_path / "refusal.jsonl"
    path.write_text(NothingFits(key=key, parts=parts, message="a new search", time=time.time()).to_json() + "\n")
    with PlanCache(tmp_path / "bob.db") as bob:
        assert bob.import_(path).nothing_fits == (key,)
        record = bob.nothing_fits(key)
    assert record is not None and record.message == "a new search" and record.origin == "import:refusal.jsonl"


def test_escapes_in_a_team_row_are_escaped_in_the_served_plan(
        alice: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    row = json.loads(json.dumps(alice))
    trials = [{**t, "note": f"{ESCAPES}note"} for t in row["plan"]["evidence"]["trials"]]
    team_of(tmp_path, monkeypatch, rekeyed(row, reason=f"{ESCAPES}fastest", trials=trials))
    plan = bob_fits(tmp_path)
    assert plan.source == "cache"
    assert "\x1b" not in plan.reason and "\x07" not in plan.reason
    assert plan.reason.startswith("\\x1b[2J\\x1b]0;owned\\x07fastest")
    assert all("\x1b" not in t.note for t in plan.trials) and "\\x1b[2J" in plan.trials[0].note
    assert all(ch.isprintable() for ch in plan.summary())


def test_escapes_in_an_imported_row_are_escaped_in_the_cache(tmp_path: Path) -> None:
    plan, parts = sample(0)
    row = json.loads(PlanRow(key=plan.key, parts=parts, plan=plan, updated=1.0).to_json())
    row = rekeyed(row, reason=f"{ESCAPES}fastest", device_name=f"cpu{ESCAPES}")
    row["failures"] = [{"micro_batch_size": 8, "shapes": None, "note": f"{ESCAPES}oom", "time": 1.0}]
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    bob = PlanCache(tmp_path / "bob.db")
    assert bob.import_(path).accepted == (row["key"],)
    (entry,) = bob.entries()
    assert entry.plan is not None and entry.plan.reason == "\\x1b[2J\\x1b]0;owned\\x07fastest"
    assert "\x1b" not in entry.plan.device_name and "\x1b" not in entry.failures[0].note


# -- bad numbers are refused, not a crash ------------------------------------------------------------------------

def test_an_import_refuses_a_global_batch_of_ten_to_the_twelve_and_keeps_the_other_rows(tmp_path: Path) -> None:
    rows = []
    for i in (1, 2):
        plan, parts = sample(i)
        rows.append(json.loads(PlanRow(key=plan.key, parts=parts, plan=plan, updated=1.0).to_json()))
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (rows[0], huge_row(), rows[1])))
    result = CliRunner().invoke(main, ["cache", "--cache", str(tmp_path / "bob.db"), "import", str(path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)  # a ClickException, no traceback
    assert "Traceback" not in result.output and "MemoryError" not in result.output
    (refused,) = [line for line in result.output.splitlines() if line.startswith("rejected")]
    assert refused == ("rejected line 2: plan splits a global batch of 1,000,000,000,000 over 1 rank(s) into "
                       "250,000,000,000 micro-batches of 4 per step, over the 1,048,576 a plan may have")
    assert "imported 2 plan(s)" in result.output
    assert sorted(e.key for e in PlanCache(tmp_path / "bob.db").entries()) == sorted(r["key"] for r in rows)
