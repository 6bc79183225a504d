"""A plan's reason is rendered from the search's account and the typed findings of every step after it, in one
function: a finding is stored with the plan, read back equal, and no module edits the reason as text."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from cache_samples import clean_environment, sample  # noqa: F401 - autouse fixture

from autotune.cache.rows import PlanRow
from autotune.cache.store import PlanCache
from autotune.evidence import Finding, render
from autotune.plan import Plan

PACKAGE = Path(__file__).resolve().parents[1] / "autotune"
RENDERER = PACKAGE / "evidence.py"

SHARDED = Finding(kind="sharding", clause="sharded with FSDP2: 180.0 samples/s", subject="sharded with FSDP2",
                  place="before", figures={"samples_per_second": 180.0, "ratio": 1.8})
LOSS = Finding(kind="loss", clause="weighted by samples", subject="weighting")
VERIFIED = Finding(kind="verified", clause="verified here by one trial", subject="team:/tmp/t",
                   figures={"peak_bytes": 1000, "samples_per_second": 80.0})

# How a module edits a reason as text: a reason keyword given an f-string, or built from a reason; a reason
# concatenated; a reason put before or after a "; " in an f-string.
EDITS = re.compile(r'reason=f"|\.reason\s*\+|reason\s*\+\s*"|\{[A-Za-z_.]*reason\}\s*;|;\s*\{[A-Za-z_.]*reason\}'
                   r"|\breason=[^,\n]*\.reason\b")


def test_the_reason_is_the_account_then_each_finding_in_its_place() -> None:
    assert render("picked", ()) == "picked"
    assert render("picked", (LOSS, SHARDED)) == "sharded with FSDP2: 180.0 samples/s; picked; weighted by samples"
    recovered = Finding(kind="grown", clause="grown back to micro-batch 4 after 3 clean steps", place="instead",
                        figures={"micro_batch_size": 4, "clean_steps": 3})
    assert render("picked", (LOSS, recovered, LOSS)) == "grown back to micro-batch 4 after 3 clean steps; " \
                                                        "weighted by samples"
    assert render("", (LOSS,)) == "weighted by samples"  # a plan with no account yet: the finding alone


def test_a_finding_is_checked_as_it_is_made() -> None:
    with pytest.raises(ValueError, match="Finding.kind must be one of"):
        Finding(kind="whatever", clause="x")
    with pytest.raises(ValueError, match="Finding.place must be one of"):
        Finding(kind="loss", clause="x", place="middle")
    with pytest.raises(ValueError, match="Finding.clause must say what was found"):
        Finding(kind="loss", clause="")
    with pytest.raises(ValueError, match=r"Finding.figures\['ratio'\] must be a non-negative number"):
        Finding(kind="sharding", clause="x", figures={"ratio": "fast"})


def test_findings_round_trip_through_the_plan_dict_and_an_old_dict_still_reads() -> None:
    plan, _ = sample(0)
    noted = plan.with_finding(SHARDED).with_finding(LOSS)
    assert noted.reason == f"{SHARDED.clause}; sample 0; {LOSS.clause}" and noted.evidence.account == "sample 0"
    d = json.loads(json.dumps(noted.to_dict()))
    assert d["evidence"]["reason"] == noted.reason  # what a reader of the JSON sees: the whole reason
    again = Plan.from_dict(d)
    assert again == noted and again.findings == (SHARDED, LOSS) and again.reason == noted.reason
    # A plan without findings is written as before any plan had them: its reason is its account.
    plain = plan.to_dict()["evidence"]
    assert plain["reason"] == "sample 0" and "findings" not in plain and "account" not in plain
    assert Plan.from_dict(plan.to_dict()).findings == ()
    assert noted.with_finding(LOSS, once=True) is noted  # its reason says that clause already
    d["evidence"]["reason"] = "sample 0; fastest by far"  # edited by hand: no longer what the findings say
    with pytest.raises(ValueError, match="not what its account and findings say"):
        Plan.from_dict(d)


def test_a_plan_with_findings_stored_in_the_cache_and_exported_reads_back_with_the_same_findings_and_reason(
        tmp_path: Path) -> None:
    plan, parts = sample(1)
    noted = plan.with_finding(SHARDED).with_finding(LOSS).with_finding(VERIFIED)
    store = PlanCache(tmp_path / "plans.db")
    store.put(noted, parts)
    got = store.get(plan.key)
    assert got is not None
    assert got.findings == noted.findings and got.reason == noted.reason
    assert got.evidence.account == "sample 1"
    row = PlanRow.from_json(PlanRow(key=plan.key, parts=parts, plan=noted).to_json())  # export, then import
    assert row.plan.findings == noted.findings and row.plan.reason == noted.reason
    forged = noted.with_finding(Finding(kind="note", clause="\x1b[2Jcleared", subject="\x1b[31m"))
    read = PlanRow.from_json(PlanRow(key=plan.key, parts=parts, plan=forged).to_json()).plan.findings[-1]
    assert (read.clause, read.subject) == ("\\x1b[2Jcleared", "\\x1b[31m")  # escaped, never printed raw


def test_no_module_edits_the_reason_as_text() -> None:
    edits = [f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py")) if path != RENDERER
             for n, line in enumerate(path.read_text().splitlines(), 1) if EDITS.search(line)]
    assert edits == [], "add a Finding (plan.with_finding) instead:\n" + "\n".join(edits)


def test_a_tuned_plans_reason_is_its_account_and_typed_findings_rendered():
    import autotune

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    batch = {"x": torch.randn(32, 16), "y": torch.randint(0, 4, (32,))}
    loss = lambda m, b: torch.nn.functional.cross_entropy(m(b["x"]), b["y"])  # noqa: E731
    plan = autotune.fit(model, batch, loss_fn=loss, memory_budget="1GiB", cache=False)
    assert plan.findings and all(f.kind in ("note", "noise") or f.place != "instead" for f in plan.findings)
    assert plan.reason == render(plan.evidence.account, plan.findings)
    assert plan.reason.startswith(plan.evidence.account)  # no decision before it here: the account leads


def test_a_step_that_replaced_the_pick_leads_with_then():
    leads = Finding(kind="partitioned state", clause="the state partitioned: 1.30x", place="leads")
    before = Finding(kind="note", clause="sharded with FSDP2", place="before")
    assert render("bf16 at micro-batch 8", [leads, before]) == (
        "sharded with FSDP2; the state partitioned: 1.30x; then: bf16 at micro-batch 8")
