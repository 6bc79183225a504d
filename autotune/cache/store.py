"""The plan cache: plans in a local SQLite file (through sqlite-utils), shared by a team as JSON lines.

One file per user: `$AUTOTUNE_CACHE`, else `$XDG_CACHE_HOME/autotune/plans.db` (`~/.cache/...` by
default); a directory autotune creates is 0700, the file 0600 (SQLite gives its -wal/-shm files the same
mode).

Failures are kept: an OOM seen in real training against a plan (`mark_unsafe`) means `get` never returns
that plan again, and `max_safe_micro_batch` bounds the next search below the smallest failing micro-batch.
A search that found nothing under its budget is kept too (`record_nothing_fits`), so a retry learns it at once;
it is exported beside the plans, so a teammate learns it too. After a local miss, `get` and `nothing_fits`
read the team's exports in `$AUTOTUNE_TEAM_DIR` (read-only). A plan for a key beats a "nothing fits" record
for it, wherever either came from.

The cache never breaks training: database trouble gives one `CacheWarning` and the cache carries on
without its database (`guard`); with `strict=True` (the CLI) it raises `CacheError`, naming the fix.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TextIO, TypeVar

from .. import settings
from ..errors import InvalidSetting
from ..evidence import Trial
from ..plan import Plan
from . import tables
from .files import CACHE_ENV, TEAM_DIR_ENV, expanded, filesystem_type, is_network_filesystem
from .guard import DEFAULT_TIMEOUT, CacheConnection, CacheError, CacheWarning, _warn_once
from .key import check_parts, key_parts, plan_key
from .lines import read_rows, write_rows
from .rows import CacheEntry, Failure, NothingFits, PlanRow, check_plan_matches, parse_row, printable
from .team import TeamDir

__all__ = ["CacheEntry", "CacheError", "CacheWarning", "ImportReport", "NothingFits", "PlanCache", "default_path",
           "filesystem_type", "is_network_filesystem", "key_parts", "open_cache", "plan_key"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class ImportReport:
    """What `PlanCache.import_` did: the keys of the valid plan rows and of the valid "nothing fits" rows
    (stored, unless this cache holds a newer plan, or a plan or newer record for a refusal's key), and
    (line number, reason) for every rejected row."""

    accepted: tuple[str, ...]
    rejected: tuple[tuple[int, str], ...]
    nothing_fits: tuple[str, ...] = ()


def default_path() -> Path:
    """`$AUTOTUNE_CACHE`, else `$XDG_CACHE_HOME/autotune/plans.db`, else `~/.cache/autotune/plans.db`."""
    env = settings.read(CACHE_ENV)
    if env and env.lower() not in ("0", "false", "off", "no"):
        return expanded(env)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"  # XDG: relative values are ignored
    return base / "autotune" / "plans.db"


def open_cache(setting: Any) -> PlanCache | None:
    """The cache `fit` uses: None (the default path), a path, a `PlanCache` (as is), or False (no cache).

    Database trouble never raises here: the cache warns once and carries on without its database.

    Raises:
        InvalidSetting: `setting` is none of the above.
    """
    if setting is False:
        return None
    if isinstance(setting, PlanCache):
        return setting
    if setting is None or setting is True:
        return PlanCache()
    if isinstance(setting, (str, os.PathLike)) and str(setting):
        return PlanCache(setting)
    raise InvalidSetting(f"cache={setting!r}: pass a path, an autotune.PlanCache, or False to turn the cache off")


class PlanCache(CacheConnection):
    """Plans by key in a SQLite file, with the OOMs seen against them, and a team's exports read-only.

    Large: the public cache of the API, one method per operation on the file (get, put, list, delete,
    export, import, the OOMs and nothing-fits records), each a few lines over the one guarded connection it
    inherits (guard.py); the reads and writes live in tables.py, the file in db.py, the team's exports in team.py.

    Example:
        >>> cache = autotune.PlanCache("~/plans.db")
        >>> plan = autotune.fit(model, batch, global_batch_size=64, cache=cache)
        >>> cache.export("team/plans.jsonl")
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 strict: bool = False, team_dir: str | os.PathLike[str] | None = None) -> None:
        """Open (creating if needed) the cache at `path`.

        Args:
            path: the SQLite file; default `default_path()`.
            timeout: seconds to wait for another process's lock before giving up.
            strict: raise `CacheError` on database trouble instead of warning and carrying on without it.
            team_dir: a directory of exported `*.jsonl` files read after a local miss; default $AUTOTUNE_TEAM_DIR.

        Raises:
            CacheError: only with `strict=True`, when the database cannot be used.
        """
        super().__init__(expanded(path) if path is not None else default_path(), timeout=timeout, strict=strict)
        team = team_dir if team_dir is not None else settings.read(TEAM_DIR_ENV) or None
        self.team = TeamDir(team) if team else None

    def __repr__(self) -> str:
        return f"PlanCache({str(self.path)!r}{', off: ' + self.problem if self.problem else ''})"

    def __enter__(self) -> PlanCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- lookups ---------------------------------------------------------------------------------------------

    def get(self, key: str) -> Plan | None:
        """The plan for `key`, from this cache or else the team directory; never one seen to run out of memory."""
        plan, failing = self._use("read a plan", lambda db: tables.local_plan(db, key), (None, None))
        team = self._team_row(key)
        failing = _smaller(failing, _smallest(team.failures) if team else None)
        for candidate in (plan, team.plan if team else None):
            if candidate is not None and (failing is None or candidate.micro_batch_size < failing):
                return candidate.with_provenance(key=key)
        return None

    def max_safe_micro_batch(self, key: str) -> int | None:
        """Largest micro-batch below every OOM seen in real runs for `key` (at least 1); None if none was seen."""
        failing = self._use("read failures", lambda db: tables.smallest_failure(db, key), None)
        team = self._team_row(key)
        failing = _smaller(failing, _smallest(team.failures) if team else None)
        # Micro-batch 1 itself failing leaves nothing smaller: the search then has to climb to a lighter rung.
        return None if failing is None else max(1, failing - 1)

    def entries(self, prefix: str = "", *, team: bool = False) -> builtins.list[CacheEntry]:
        """Cached plans whose key starts with `prefix`, newest first; with `team`, the team's too."""
        prefix = prefix.lower()
        found = self._use("list plans", lambda db: tables.entries(db, prefix), [])
        if team and self.team is not None:
            have = {e.key for e in found}
            found += [CacheEntry.from_row(row, self.team.origin) for key, row in self._team_rows().items()
                      if key.startswith(prefix) and key not in have]
        return found

    def nothing_fits_entries(self, prefix: str = "", *, team: bool = False) -> builtins.list[NothingFits]:
        """"Nothing fits" records whose key starts with `prefix` and holds no plan, newest first; with `team`,
        the team directory's too (under keys without a record or plan here, or a plan there)."""
        prefix = prefix.lower()
        found = self._use("list 'nothing fits' records", lambda db: tables.all_nothing_fits(db, prefix), [])
        if team and self.team is not None:
            skip = {r.key for r in found} | {e.key for e in self.entries(prefix, team=True)}
            found += [r for key, r in self._team(lambda t: t.nothing_fits()).items()
                      if key.startswith(prefix) and key not in skip]
        return found

    def list(self) -> builtins.list[CacheEntry]:
        """Every plan in this cache, newest first."""
        return self.entries()

    # -- writes ----------------------------------------------------------------------------------------------

    def put(self, plan: Plan, parts: dict[str, Any]) -> None:
        """Store `plan` (with its trials) under the key of `parts`, replacing what was there, whatever its date.

        Raises:
            ValueError: `parts` are malformed, or `plan` does not answer them (another key, budget...).
        """
        check_parts(parts)
        key = plan_key(parts)
        if plan.key and plan.key != key:
            raise ValueError(f"plan.key {plan.key[:12]}... is not the key of these parts ({key[:12]}...)")
        plan = plan.with_provenance(key=key)
        check_plan_matches(plan, key, parts)
        row = PlanRow(key=key, parts=parts, plan=plan, updated=time.time())
        self._use("save the plan", lambda db: tables.upsert(db, row, "tuned"), None)

    def replace(self, key: str, plan: Plan) -> None:
        """Store a new plan for a key already cached, keeping its parts (after a recovery mid-training)."""
        plan = plan.with_provenance(key=key)
        if not self._use("replace the plan", lambda db: tables.replace_plan(db, key, plan), 1):
            log.debug("plan cache: no plan under %s to replace", key[:12])

    def keep_verified(self, key: str, plan: Plan, origin: str) -> None:
        """Store `plan`, a plan from `origin` ("import:<file>") with the figures one trial here measured in place
        of its claims, over the imported row it came from; the row is then measured here, and served as stored.
        A team directory's plan has no row here to keep it in, and is verified again by the next `fit`."""
        plan = plan.with_provenance(key=key)
        if not self._use("keep the verified plan", lambda db: tables.keep_verified(db, key, plan, origin), 0):
            log.debug("plan cache: no row from %s under %s to keep the verified plan in", origin, key[:12])

    def mark_unsafe(self, key: str, *, micro_batch_size: int, shapes: dict | None = None, note: str = "") -> None:
        """Record an OOM seen in real training: `get` stops returning plans at or above `micro_batch_size`.

        Args:
            key: the plan's key (`plan.key`).
            micro_batch_size: the micro-batch that ran out of memory.
            shapes: the failing batch's tensor shapes, e.g. {"input_ids": [8, 4096]}.
            note: free text, e.g. the first line of the error.

        Raises:
            ValueError: `micro_batch_size` is not a positive integer, or `shapes` is not a dict.
        """
        shapes = json.loads(json.dumps(shapes, default=str)) if shapes is not None else None  # torch.Size -> list
        failure = Failure(micro_batch_size=micro_batch_size, shapes=shapes, note=str(note), time=time.time())
        self._use("record the failure", lambda db: tables.insert_failures(db, key, [failure]), None)

    def nothing_fits(self, key: str) -> NothingFits | None:
        """The record that an earlier search under `key` found no configuration that fits, or None.

        This cache's record, else (after a local miss) the team directory's; its `origin` says which:
        "search", "import:<file>" or "team:<dir>". None where a plan is stored for `key`, here or in the
        team directory: a plan is a configuration measured to fit, and beats a search that found none.
        """
        record, planned = self._use("read a 'nothing fits' record", lambda db: tables.nothing_fits(db, key),
                                    (None, False))
        if record is not None or planned or self.team is None:
            return record
        team = self._team(lambda t: t.nothing_fits()).get(key)
        return None if team is None or self._team_row(key) is not None else team

    def record_nothing_fits(self, parts: dict[str, Any], message: str, trials: tuple[Trial, ...] = ()) -> str:
        """Remember that nothing fits the workload of `parts`, so the next `fit` says so in milliseconds.

        Returns:
            The key it is recorded under.

        Raises:
            ValueError: `parts` are malformed.
        """
        check_parts(parts)
        row = NothingFits(key=plan_key(parts), parts=parts, message=str(message), trials=tuple(trials),
                          time=time.time())
        self._use("record that nothing fits", lambda db: tables.record_nothing_fits(db, row), None)
        return row.key

    def delete(self, key: str) -> bool:
        """Forget the plan and the failures under `key`; True if a plan was there."""
        return self._use("delete a plan", lambda db: tables.delete(db, key), False)

    def clear(self) -> int:
        """Forget every plan and failure; returns how many plans there were."""
        return self._use("clear the cache", tables.clear, 0)

    # -- sharing ---------------------------------------------------------------------------------------------

    def export(self, path: str | os.PathLike[str] | TextIO) -> int:
        """Write every valid plan, with its parts and failures, and every "nothing fits" record (under a key
        without a plan) as JSON lines to `path` (or a text stream); returns how many rows.

        Raises:
            OSError: `path` cannot be written.
        """
        rows: builtins.list[PlanRow | NothingFits] = []
        for entry in self.entries():
            try:
                row = entry.to_row()
            except ValueError as exc:  # written by another format: an import would reject it too
                log.warning("plan cache: not exporting %s: %s", entry.key[:12], exc)
                continue
            if row is not None:
                rows.append(row)
        for record in self.nothing_fits_entries():
            try:  # only what an import would accept: the same validation, on the row as written
                rows.append(parse_row(record.to_json()))
            except ValueError as exc:
                log.warning("plan cache: not exporting 'nothing fits' %s: %s", record.key[:12], exc)
        return write_rows(path, rows)

    def import_(self, path: str | os.PathLike[str] | BinaryIO) -> ImportReport:
        """Validate every row of an export (a file, or a binary stream) and store the good ones (a newer
        local plan is kept; a "nothing fits" record is kept out by a local plan or a newer local record).

        Raises:
            OSError: the file cannot be read.
        """
        results = builtins.list(read_rows(path))
        plans = [row for _, row, _ in results if isinstance(row, PlanRow)]
        refusals = [row for _, row, _ in results if isinstance(row, NothingFits)]
        rejected = tuple((n, why) for n, row, why in results if row is None)
        origin = f"import:{Path(path).name if isinstance(path, (str, os.PathLike)) else 'stdin'}"
        stored = self._use("import plans", lambda db: tables.import_rows(db, plans, refusals, origin), False)
        if not stored:
            return ImportReport(accepted=(), rejected=rejected)
        return ImportReport(accepted=tuple(r.key for r in plans), rejected=rejected,
                            nothing_fits=tuple(r.key for r in refusals))

    def _team(self, read: Callable[[TeamDir], dict[str, T]]) -> dict[str, T]:
        """What `read` gets from the team directory; {} without one, or when it fails (said once)."""
        if self.team is None:
            return {}
        try:
            found = read(self.team)
        except Exception as exc:  # noqa: BLE001 - the team directory never fails a fit
            self.team.problems.append(f"team directory {self.team.path} ($AUTOTUNE_TEAM_DIR) skipped: "
                                      f"{type(exc).__name__}: {exc}")
            self.team.forget()
            found = {}
        for problem in self.team.problems:
            _warn_once(str(self.team.path), problem, printable(problem))
        return found

    def _team_rows(self) -> dict[str, PlanRow]:
        return self._team(lambda t: t.rows())

    def _team_row(self, key: str) -> PlanRow | None:
        return self._team_rows().get(key)


def _smallest(failures: tuple[Failure, ...]) -> int | None:
    return min((f.micro_batch_size for f in failures), default=None)


def _smaller(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)
