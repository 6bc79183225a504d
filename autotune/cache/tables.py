"""The plan cache's reads and writes, through sqlite-utils' `Table` API.

Tables: `plans` (key, parts, plan, origin, created, updated), `failures` (OOMs seen in training against a
key) and `nothing_fits` (searches that found no configuration under their budget). Every write runs under
`immediate` (the write lock taken up front); a read of several statements runs in one transaction, so it
sees one snapshot. Stored JSON that no longer validates is a miss, never trusted: a plan of another plan
format is "stale" (tuned again), one that fails validation otherwise "invalid".
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

from sqlite_utils import Database

from ..evidence import Trial
from ..plan import Plan, StalePlanFormat
from .db import immediate
from .rows import VERIFIED, CacheEntry, Failure, NothingFits, PlanRow

log = logging.getLogger(__name__)

CLOCK_SKEW = 60.0  # seconds a stored date may run ahead of this clock and still outrank a row written now
_PREFIX = "substr(key, 1, length(:prefix)) = :prefix"  # keys that start with :prefix
_NO_PLAN = "NOT EXISTS (SELECT 1 FROM plans WHERE plans.key = nothing_fits.key)"  # a plan beats a refusal


def _one(db: Database, table: str, key: str, select: str = "*") -> dict[str, Any] | None:
    """The row of `table` under `key` (its `select` columns), or None; the cursor is read to its end."""
    rows = list(db.table(table).rows_where("key = ?", [key], select=select, limit=1))
    return rows[0] if rows else None


@contextlib.contextmanager
def _snapshot(db: Database) -> Iterator[Database]:
    """Several reads that see one state of the file (a deferred transaction that writes nothing)."""
    with db.atomic():
        yield db


# -- plans -------------------------------------------------------------------------------------------------------

def upsert(db: Database, row: PlanRow, origin: str) -> None:
    """Store a plan a search here just made under its key, replacing whatever is stored: a new search is the
    latest word on its key, whatever date the stored row carries (a clock stepped back since it was written)."""
    with immediate(db):
        _upsert(db, row, origin, newer_only=False)


def _upsert(db: Database, row: PlanRow, origin: str, *, newer_only: bool = True) -> None:
    """Store `row`; with `newer_only` (an import), an older row never overwrites a newer one (`updated`), and a
    stored row dated in the future (a clock set wrong, a date written unclamped) counts as older than any."""
    now = time.time()
    stored = _one(db, "plans", row.key, "updated")
    record = {"key": row.key, "parts": json.dumps(row.parts, sort_keys=True), "plan": json.dumps(row.plan.to_dict()),
              "origin": origin, "updated": row.updated}
    if stored is None:
        db.table("plans").insert({**record, "created": max(now, row.updated)})
    elif (not newer_only or row.updated >= (stored["updated"] or 0.0)
          or (stored["updated"] or 0.0) > now + CLOCK_SKEW):
        db.table("plans").update(row.key, record)


def replace_plan(db: Database, key: str, plan: Plan) -> int:
    """Swap the plan under `key`, keeping its parts; returns 0 when no plan was there."""
    with immediate(db):
        if not db.table("plans").count_where("key = ?", [key]):
            return 0
        db.table("plans").update(key, {"plan": json.dumps(plan.to_dict()), "origin": "replaced",
                                       "updated": time.time()})
    return 1


def keep_verified(db: Database, key: str, plan: Plan, origin: str) -> int:
    """Swap the plan under `key` for `plan` (its figures measured here), where the row is still the one from
    `origin` that was verified; its origin becomes `VERIFIED` and its date stays. Returns 0 where no such row is."""
    with immediate(db):
        if not db.table("plans").count_where("key = ? AND origin = ?", [key, origin]):
            return 0
        db.table("plans").update(key, {"plan": json.dumps(plan.to_dict()), "origin": VERIFIED})
    return 1


def local_plan(db: Database, key: str) -> tuple[Plan | None, int | None]:
    """The stored plan (None if absent, stale or invalid) and the smallest failing micro-batch, in one read."""
    with _snapshot(db):
        stored = _one(db, "plans", key, "plan")
        failing = smallest_failure(db, key)
    return (load_plan(stored["plan"], key)[0] if stored else None), failing


def entries(db: Database, prefix: str) -> list[CacheEntry]:
    """Plans whose key starts with `prefix`, newest first, each with its failures."""
    failures: dict[str, list[Failure]] = {}
    with _snapshot(db):
        for f in db.table("failures").rows_where(_PREFIX, {"prefix": prefix}, order_by="time"):
            with contextlib.suppress(ValueError, TypeError):  # a hand-edited row is skipped, never trusted
                failures.setdefault(f["key"], []).append(Failure(
                    micro_batch_size=f["micro_batch_size"], note=f["note"] or "", time=f["time"] or 0.0,
                    shapes=json.loads(f["shapes"]) if f["shapes"] else None))
        rows = list(db.table("plans").rows_where(_PREFIX, {"prefix": prefix}, order_by="updated DESC"))
    found = []
    for r in rows:
        plan, stale = load_plan(r["plan"], r["key"])
        found.append(CacheEntry(key=r["key"], parts=_load_json(r["parts"]), plan=plan, stale=stale,
                                failures=tuple(failures.get(r["key"], ())), created=r["created"] or 0.0,
                                updated=r["updated"] or 0.0, origin=r["origin"] or ""))
    return found


def load_plan(text: str | None, key: str) -> tuple[Plan | None, bool]:
    """(a stored plan, validated by `Plan.from_dict`, or None, whether it is of another plan format)."""
    try:
        return Plan.from_dict(json.loads(text or "")), False
    except StalePlanFormat as exc:  # an older (or newer) autotune's plan: tuned again, never misread
        log.debug("plan cache: plan %s is stale: %s", key[:12], exc)
        return None, True
    except (ValueError, TypeError) as exc:  # hand-edited or damaged: never trusted
        log.debug("plan cache: ignoring unreadable plan %s: %s", key[:12], exc)
        return None, False


def delete(db: Database, key: str) -> bool:
    with immediate(db):
        gone = db.table("plans").count_where("key = ?", [key])
        for table in ("plans", "failures", "nothing_fits"):
            db.table(table).delete_where("key = ?", [key])
    return gone > 0


def clear(db: Database) -> int:
    with immediate(db):
        gone = db.table("plans").count
        for table in ("plans", "failures", "nothing_fits"):
            db.table(table).delete_where()
    return gone


# -- failures ----------------------------------------------------------------------------------------------------

def insert_failures(db: Database, key: str, failures: Iterable[Failure]) -> None:
    """Store OOMs seen against `key`; one already stored (same micro-batch and time) is kept once."""
    with immediate(db):
        _insert_failures(db, key, failures)


def _insert_failures(db: Database, key: str, failures: Iterable[Failure]) -> None:
    db.table("failures").insert_all(
        ({"key": key, "micro_batch_size": f.micro_batch_size, "note": f.note, "time": f.time,
          "shapes": None if f.shapes is None else json.dumps(f.shapes)} for f in failures), ignore=True)


def smallest_failure(db: Database, key: str) -> int | None:
    (row,) = db.table("failures").rows_where("key = ?", [key], select="min(micro_batch_size) AS m")
    return row["m"]


# -- "nothing fits" records --------------------------------------------------------------------------------------

def record_nothing_fits(db: Database, row: NothingFits) -> None:
    """Remember that nothing fits under `row.key` (a new search here replaces any record)."""
    with immediate(db):
        db.table("nothing_fits").insert(_nothing_fits_record(row, "search"), pk="key", replace=True)


def nothing_fits(db: Database, key: str) -> tuple[NothingFits | None, bool]:
    """(the record that nothing fits under `key`, whether a plan is stored under `key`), in one read.

    Where a plan is stored the record is None: a plan, safe or not, says something fits (see
    `import_rows`). An unreadable record is None too.
    """
    with _snapshot(db):
        planned = bool(db.table("plans").count_where("key = ?", [key]))
        found = _one(db, "nothing_fits", key)
    if planned or found is None:
        return None, planned
    return _load_nothing_fits(found), False


def all_nothing_fits(db: Database, prefix: str = "") -> list[NothingFits]:
    """Every readable record under a key that starts with `prefix` and holds no plan, newest first (what an
    export shares, and `autotune cache list` shows)."""
    rows = db.table("nothing_fits").rows_where(f"{_NO_PLAN} AND {_PREFIX}", {"prefix": prefix}, order_by="time DESC")
    return [record for record in map(_load_nothing_fits, rows) if record is not None]


def import_rows(db: Database, plans: Iterable[PlanRow], refusals: Iterable[NothingFits], origin: str) -> bool:
    """Store validated rows in one transaction, plans (and their failures) first; True once committed.

    An imported "nothing fits" record is stored only where this cache holds no plan for its key and no newer
    record of its own. A plan is a configuration measured to fit, which beats a search that found none (a
    refusal would also hide it once an OOM in training marks the plan unsafe: the next search must then run,
    bounded below that OOM, not be refused). Between two refusals the newer one is kept: both say the same,
    and the newer message and trials describe the latest search; a stored one dated in the future is older.
    """
    latest = time.time() + CLOCK_SKEW
    with immediate(db):
        for row in plans:
            _upsert(db, row, origin)
            _insert_failures(db, row.key, row.failures)
        for refusal in refusals:
            if db.table("plans").count_where("key = ?", [refusal.key]):
                continue
            stored = _one(db, "nothing_fits", refusal.key, "time")
            if stored is None or refusal.time > (stored["time"] or 0.0) or (stored["time"] or 0.0) > latest:
                db.table("nothing_fits").insert(_nothing_fits_record(refusal, origin), pk="key", replace=True)
    return True


def _nothing_fits_record(row: NothingFits, origin: str) -> dict[str, Any]:
    return {"key": row.key, "parts": json.dumps(row.parts, sort_keys=True), "message": row.message,
            "trials": json.dumps([t.to_dict() for t in row.trials]), "time": row.time, "origin": origin}


def _load_nothing_fits(r: dict[str, Any]) -> NothingFits | None:
    try:
        return NothingFits(key=r["key"], parts=_load_json(r["parts"]), message=r["message"],
                           origin=r["origin"] or "search", time=r["time"] or 0.0,
                           trials=tuple(Trial.from_dict(t) for t in json.loads(r["trials"] or "[]")))
    except (ValueError, TypeError) as exc:  # hand-edited or another format: never trusted, a miss
        log.debug("plan cache: ignoring unreadable 'nothing fits' record %s: %s", r["key"][:12], exc)
        return None


def _load_json(text: str | None) -> dict:
    with contextlib.suppress(ValueError, TypeError):
        value = json.loads(text or "")
        if isinstance(value, dict):
            return value
    return {}
