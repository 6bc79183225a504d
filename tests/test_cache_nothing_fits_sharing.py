"""'Nothing fits' shared: a search that found no configuration reaches a teammate as it reaches a retry.

Real SQLite files, the real `autotune.fit` on a tiny GPT on the CPU under a 64 KiB budget (nothing fits: a
search of a few trials), exports and team directories as files. Alice searches; Bob, with a fresh cache,
learns it from her export (imported, or read from the team directory) in milliseconds, without a trial.
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
from cache_samples import cache_warnings, clean_environment, sample, tiny_workload  # noqa: F401 - autouse fixture
from click.testing import CliRunner

import autotune
from autotune.cache.key import plan_key
from autotune.cache.store import PlanCache
from autotune.cli.main import main
from autotune.errors import NoFeasiblePlan

NOTHING_FITS = dict(global_batch_size=8, device="cpu", memory_budget="64KiB", trial_steps=1)
FAST = 1.0  # seconds: a refusal served from a cache; the search it replaces runs trials


@pytest.fixture
def alice(tmp_path: Path) -> tuple[NoFeasiblePlan, Path]:
    """Alice's search that finds nothing, and her cache file (which now holds the refusal)."""
    model, batch = tiny_workload()
    cache = tmp_path / "alice.db"
    with pytest.raises(NoFeasiblePlan) as searched:
        autotune.fit(model, batch, cache=cache, **NOTHING_FITS)
    assert searched.value.trials and "cached under key" not in str(searched.value)
    return searched.value, cache


def bob_fits(cache: Path, caplog: pytest.LogCaptureFixture, **settings: Any) -> tuple[NoFeasiblePlan, float, list]:
    """Bob's `fit` on the same workload: the error, the seconds it took, and the search's log records."""
    model, batch = tiny_workload()
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="autotune")
    started = time.perf_counter()
    with pytest.raises(NoFeasiblePlan) as refused:
        autotune.fit(model, batch, cache=cache, **NOTHING_FITS, **settings)
    seconds = time.perf_counter() - started
    searched = [r for r in caplog.records if r.name.startswith(("autotune.search", "autotune.progress"))
                or r.getMessage().startswith("autotune: tuning on")]
    return refused.value, seconds, searched


def assert_served(refused: NoFeasiblePlan, seconds: float, searched_again: list, searched: NoFeasiblePlan,
                  where: str) -> None:
    """Bob got Alice's refusal from `where`, fast and without a trial of his own."""
    assert searched_again == [] and seconds < FAST
    assert str(searched) in str(refused) and refused.trials == searched.trials
    assert f"in {where}; pass retune=True to search again" in str(refused)


def assert_retune_searches(cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The control: with retune=True a search runs, and the detector `bob_fits` uses sees its trials."""
    again, _, ran = bob_fits(cache, caplog, retune=True)
    assert ran and again.trials and "cached under key" not in str(again)


def export_rows(cache: Path, target: Path) -> list[dict]:
    PlanCache(cache).export(target)
    return [json.loads(line) for line in target.read_text().splitlines()]


def test_an_imported_refusal_makes_a_fresh_cache_fail_fast_without_a_trial(
        alice: tuple[NoFeasiblePlan, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    searched, alice_cache = alice
    assert PlanCache(alice_cache).export(tmp_path / "alice.jsonl") == 1
    (row,) = [json.loads(line) for line in (tmp_path / "alice.jsonl").read_text().splitlines()]
    assert row["kind"] == "nothing_fits" and row["key"] == plan_key(row["parts"])

    bob = PlanCache(tmp_path / "bob.db")
    report = bob.import_(tmp_path / "alice.jsonl")
    assert report.rejected == () and report.accepted == () and report.nothing_fits == (row["key"],)
    bob.close()

    assert_served(*bob_fits(tmp_path / "bob.db", caplog), searched, f"{tmp_path / 'bob.db'} (import:alice.jsonl)")
    assert_retune_searches(tmp_path / "bob.db", caplog)


def test_a_refusal_in_the_team_directory_is_read_after_a_local_miss_and_never_copied(
        alice: tuple[NoFeasiblePlan, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    searched, alice_cache = alice
    team = tmp_path / "team"
    team.mkdir()
    export_rows(alice_cache, team / "alice.jsonl")
    before = {p.name: p.stat().st_mtime_ns for p in team.iterdir()}
    monkeypatch.setenv("AUTOTUNE_TEAM_DIR", str(team))

    with cache_warnings() as caught:
        served = bob_fits(tmp_path / "bob.db", caplog)
    assert_served(*served, searched, f"team:{team}")
    assert caught == []
    with contextlib.closing(sqlite3.connect(tmp_path / "bob.db")) as conn:  # read, not copied
        assert conn.execute("SELECT count(*) FROM nothing_fits").fetchone() == (0,)
    assert {p.name: p.stat().st_mtime_ns for p in team.iterdir()} == before
    assert_retune_searches(tmp_path / "bob.db", caplog)


def test_a_tampered_refusal_is_rejected_and_the_search_runs(
        alice: tuple[NoFeasiblePlan, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    _, alice_cache = alice
    (row,) = export_rows(alice_cache, tmp_path / "alice.jsonl")
    wrong_key = {**row, "parts": {**row["parts"], "budget_bytes": 2**40}}  # another workload, the same key
    rows = [wrong_key, {**row, "trials": [{"micro_batch_size": -1}]}, {**row, "message": "x" * 20_000},
            {**row, "pickle": "gASVAAAA"}, {**row, "kind": "verdict"}]
    bundle = tmp_path / "team" / "tampered.jsonl"
    bundle.parent.mkdir()
    bundle.write_text("".join(json.dumps(r) + "\n" for r in rows))

    report = PlanCache(tmp_path / "bob.db").import_(bundle)
    reasons = dict(report.rejected)
    assert report.nothing_fits == () and sorted(reasons) == [1, 2, 3, 4, 5]
    assert "does not match its parts" in reasons[1]
    assert "trials[0]" in reasons[2]
    assert "over the 16,384" in reasons[3]
    assert "unknown field(s): pickle" in reasons[4]
    assert "kind 'verdict' is neither" in reasons[5]

    monkeypatch.setenv("AUTOTUNE_TEAM_DIR", str(bundle.parent))
    with cache_warnings() as caught:
        searched, _, ran = bob_fits(tmp_path / "bob.db", caplog)
    assert ran and "cached under key" not in str(searched)
    assert len(caught) == 1 and "5 row(s) of team file" in str(caught[0].message)


def test_a_teammates_message_is_shown_with_control_characters_escaped(
        alice: tuple[NoFeasiblePlan, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, alice_cache = alice
    (row,) = export_rows(alice_cache, tmp_path / "alice.jsonl")
    row["message"] = "nothing fits\x1b]0;pwned\x07\x1b[2J"  # the message is not part of the key: still valid
    (tmp_path / "alice.jsonl").write_text(json.dumps(row) + "\n")
    assert PlanCache(tmp_path / "bob.db").import_(tmp_path / "alice.jsonl").nothing_fits == (row["key"],)

    refused, _, _ = bob_fits(tmp_path / "bob.db", caplog)
    assert "\x1b" not in str(refused) and "\x07" not in str(refused)
    assert "nothing fits\\x1b]0;pwned\\x07\\x1b[2J" in str(refused)


def test_a_local_plan_or_a_newer_local_refusal_wins_over_an_import(tmp_path: Path) -> None:
    plan, parts = sample(0)
    alice = PlanCache(tmp_path / "alice.db")
    alice.record_nothing_fits(parts, "alice: nothing fits")
    alice.export(tmp_path / "alice.jsonl")

    with_plan = PlanCache(tmp_path / "with_plan.db")
    with_plan.put(plan, parts)  # measured to fit: a refusal for its key is never stored beside it
    assert with_plan.import_(tmp_path / "alice.jsonl").nothing_fits == (plan.key,)
    assert with_plan.nothing_fits(plan.key) is None and with_plan.get(plan.key) == plan
    with_plan.mark_unsafe(plan.key, micro_batch_size=plan.micro_batch_size)  # an OOM: search lower, not refuse
    assert with_plan.get(plan.key) is None and with_plan.nothing_fits(plan.key) is None
    assert with_plan.export(tmp_path / "with_plan.jsonl") == 1  # the plan, not the refusal beside it

    newer = PlanCache(tmp_path / "newer.db")
    newer.record_nothing_fits(parts, "newer: nothing fits")  # after alice's
    newer.import_(tmp_path / "alice.jsonl")
    assert newer.nothing_fits(plan.key).message == "newer: nothing fits"

    older = PlanCache(tmp_path / "older.db")
    older.record_nothing_fits(parts, "older: nothing fits")
    alice.record_nothing_fits(parts, "alice again: nothing fits")  # a later search, exported again
    alice.export(tmp_path / "alice.jsonl")
    older.import_(tmp_path / "alice.jsonl")
    record = older.nothing_fits(plan.key)
    assert record.message == "alice again: nothing fits" and record.origin == "import:alice.jsonl"


def test_a_team_plan_wins_over_a_team_refusal(tmp_path: Path) -> None:
    plan, parts = sample(0)
    team = tmp_path / "team"
    team.mkdir()
    carol = PlanCache(tmp_path / "carol.db")
    carol.record_nothing_fits(parts, "carol: nothing fits")
    carol.export(team / "carol.jsonl")
    assert PlanCache(tmp_path / "bob.db", team_dir=team).nothing_fits(plan.key).origin == f"team:{team}"

    dave = PlanCache(tmp_path / "dave.db")
    dave.put(plan, parts)
    dave.export(team / "dave.jsonl")
    bob = PlanCache(tmp_path / "bob2.db", team_dir=team)
    assert bob.nothing_fits(plan.key) is None and bob.get(plan.key) == plan


def test_plan_rows_with_and_without_a_kind_are_read(tmp_path: Path) -> None:
    plans = []
    for i in range(2):
        plan, parts = sample(i)
        store = PlanCache(tmp_path / f"p{i}.db")
        store.put(plan, parts)
        store.export(tmp_path / f"p{i}.jsonl")
        plans.append(json.loads((tmp_path / f"p{i}.jsonl").read_text()))
    assert "kind" not in plans[0]  # as an older autotune writes, and reads
    plans[1]["kind"] = "plan"
    (tmp_path / "both.jsonl").write_text("".join(json.dumps(r) + "\n" for r in plans))
    report = PlanCache(tmp_path / "target.db").import_(tmp_path / "both.jsonl")
    assert report.rejected == () and len(report.accepted) == 2


def test_a_version_2_cache_keeps_its_refusals_through_the_migration(tmp_path: Path) -> None:
    plan, parts = sample(0)
    path = tmp_path / "v2.db"
    PlanCache(path).record_nothing_fits(parts, "found before the migration")
    with contextlib.closing(sqlite3.connect(path)) as conn:  # as schema version 2 left it: no origin column
        conn.execute("ALTER TABLE nothing_fits DROP COLUMN origin")
        conn.execute("PRAGMA user_version = 2")
        conn.commit()
    record = PlanCache(path).nothing_fits(plan.key)
    assert record.message == "found before the migration" and record.origin == "search"


def test_cli_import_counts_refusals(alice: tuple[NoFeasiblePlan, Path], tmp_path: Path) -> None:
    _, alice_cache = alice
    export_rows(alice_cache, tmp_path / "alice.jsonl")
    result = CliRunner().invoke(main, ["cache", "--cache", str(tmp_path / "bob.db"), "import",
                                       str(tmp_path / "alice.jsonl")], catch_exceptions=False)
    assert result.exit_code == 0 and "imported 0 plan(s) and 1 'nothing fits' record(s)" in result.output


def cache_cli(*args: str) -> Any:
    return CliRunner().invoke(main, ["cache", *args], catch_exceptions=False)


def test_cache_list_show_and_delete_see_refusals_here_and_in_the_team_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan, parts = sample(0)
    mine = tmp_path / "mine.db"
    PlanCache(mine).record_nothing_fits(parts, "nothing fits\x1b[2J under 1 GiB", plan.trials)
    team = tmp_path / "team"
    team.mkdir()
    theirs_plan, theirs_parts = sample(1)
    carol = PlanCache(tmp_path / "carol.db")
    carol.record_nothing_fits(theirs_parts, "carol: nothing fits")
    carol.export(team / "carol.jsonl")
    monkeypatch.setenv("AUTOTUNE_TEAM_DIR", str(team))

    listed = cache_cli("--cache", str(mine), "list")
    assert "no cached plans in" in listed.output and "searches that found nothing fits" in listed.output
    (row,) = [line for line in listed.output.splitlines() if line.startswith(plan.key[:12])]
    assert row.split()[-1] == "search" and theirs_plan.key[:12] not in listed.output
    with_team = json.loads(cache_cli("--cache", str(mine), "list", "--team", "--json").output)
    assert [(e["key"], e["status"], e["origin"]) for e in with_team] == [
        (plan.key, "nothing fits", "search"), (theirs_plan.key, "nothing fits", f"team:{team}")]

    shown = cache_cli("--cache", str(mine), "show", plan.key[:10]).output
    assert "status    nothing fits" in shown and "nothing fits\\x1b[2J under 1 GiB" in shown and "\x1b" not in shown
    assert "simulated OOM" in shown  # its trials

    assert cache_cli("--cache", str(mine), "delete", plan.key[:10]).exit_code == 0
    assert PlanCache(mine).nothing_fits(plan.key) is None
