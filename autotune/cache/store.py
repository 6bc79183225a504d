"""The plan cache: plans in a local SQLite file (through sqlite-utils), shared by a team as JSON lines.

One file per user: `$AUTOTUNE_CACHE`, else `$XDG_CACHE_HOME/autotune/plans.db` (`~/.cache/...` by
default); a directory autotune creates is 0700, the file 0600 (SQLite gives its -wal/-shm files the same
mode). The file itself (WAL, busy timeout, single-statement writes, schema migrations) is `cache_db`; the
key is `cache_key`; the JSON-lines rows of export / import / team directory are `cache_rows`.

Failures are kept: an OOM seen in real training against a plan (`mark_unsafe`) means `get` never returns
that plan again, and `max_safe_micro_batch` bounds the next search below the smallest failing micro-batch.
A search that found nothing under its budget is kept too (`record_nothing_fits`), so a retry learns it at once;
it is exported beside the plans, so a teammate learns it too. After a local miss, `get` and `nothing_fits`
read the team's exports in `$AUTOTUNE_TEAM_DIR` (read-only). A plan for a key beats a "nothing fits" record
for it, wherever either came from.

The cache never breaks training. A locked (past the timeout), corrupt, unwritable or full database, or
one on a network file system, gives one `CacheWarning`, and the cache carries on without its database
(a corrupt file of ours is first moved aside as `plans.db.corrupt-<time>` and a new one started).
With `strict=True` (the CLI) those raise `CacheError`, naming the fix.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import logging
import os
import sqlite3
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TextIO, TypeVar

from sqlite_utils import Database

from . import db as cache_db
from .db import CACHE_ENV, TEAM_DIR_ENV, expanded, filesystem_type, is_network_filesystem, unknown_home
from .key import check_parts, key_parts, plan_key
from .rows import (CacheEntry, Failure, NothingFits, PlanRow, check_plan_matches, parse_row, printable, read_rows,
                   write_rows)
from .team import TeamDir
from ..errors import AutotuneError, InvalidSetting
from ..evidence import Trial
from ..plan import Plan

__all__ = ["CacheEntry", "CacheError", "CacheWarning", "ImportReport", "NothingFits", "PlanCache", "default_path",
           "filesystem_type", "is_network_filesystem", "key_parts", "open_cache", "plan_key"]

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_TIMEOUT = 10.0  # seconds a statement waits for another process's lock before giving up (then: no cache)


class CacheWarning(UserWarning):
    """The plan cache is unusable for now; autotune carries on without it."""


class CacheError(AutotuneError):
    """The plan cache is unusable (raised only with `strict=True`, as the CLI uses it); the message says why."""


_warned: set[tuple[str, str]] = set()  # (path, problem) already reported in this process


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
    env = os.environ.get(CACHE_ENV, "")
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


class PlanCache:
    """Plans by key in a SQLite file, with the OOMs seen against them, and a team's exports read-only.

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
        self.path = expanded(path) if path is not None else default_path()
        self.timeout = float(timeout)
        self.strict = strict
        team = team_dir if team_dir is not None else os.environ.get(TEAM_DIR_ENV) or None
        self.team = TeamDir(team) if team else None
        self.problem: str | None = None  # why the database is off ("locked", "corrupt"...), once it is
        self._db: Database | None = None
        self._pid = os.getpid()
        self._lock = threading.RLock()  # one connection, shared by threads one statement at a time
        home = unknown_home(self.path)
        if home is not None:  # never a directory literally named "~user" in the working directory
            self._off("readonly", f"no home directory is known for {home}")
        with self._lock:
            self._database()

    def __repr__(self) -> str:
        return f"PlanCache({str(self.path)!r}{', off: ' + self.problem if self.problem else ''})"

    def __getstate__(self) -> dict[str, Any]:
        """A copy (pickle, `copy.deepcopy` of a plan that carries this cache) holds the path and settings,
        never the connection: it opens its own when first used, as after a fork."""
        state = dict(self.__dict__)
        state["_db"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def __enter__(self) -> PlanCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def database(self) -> Database | None:
        """The open sqlite-utils `Database`, or None while the cache is off (for inspection and tests)."""
        with self._lock:
            return self._database()

    def close(self) -> None:
        with self._lock:
            if self._db is not None and self._pid == os.getpid():
                self._db.close()
            self._db = None

    # -- lookups ---------------------------------------------------------------------------------------------

    def get(self, key: str) -> Plan | None:
        """The plan for `key`, from this cache or else the team directory; never one seen to run out of memory."""
        plan, failing = self._use("read a plan", lambda db: cache_db.local_plan(db, key), (None, None))
        team = self._team_row(key)
        failing = _smaller(failing, _smallest(team.failures) if team else None)
        for candidate in (plan, team.plan if team else None):
            if candidate is not None and (failing is None or candidate.micro_batch_size < failing):
                return candidate.with_provenance(key=key)
        return None

    def max_safe_micro_batch(self, key: str) -> int | None:
        """Largest micro-batch below every OOM seen in real runs for `key` (at least 1); None if none was seen."""
        failing = self._use("read failures", lambda db: cache_db.smallest_failure(db, key), None)
        team = self._team_row(key)
        failing = _smaller(failing, _smallest(team.failures) if team else None)
        # Micro-batch 1 itself failing leaves nothing smaller: the search then has to climb to a lighter rung.
        return None if failing is None else max(1, failing - 1)

    def entries(self, prefix: str = "", *, team: bool = False) -> builtins.list[CacheEntry]:
        """Cached plans whose key starts with `prefix`, newest first; with `team`, the team's too."""
        prefix = prefix.lower()
        found = self._use("list plans", lambda db: cache_db.entries(db, prefix), [])
        if team and self.team is not None:
            have = {e.key for e in found}
            found += [CacheEntry.from_row(row, self.team.origin) for key, row in self._team_rows().items()
                      if key.startswith(prefix) and key not in have]
        return found

    def nothing_fits_entries(self, prefix: str = "", *, team: bool = False) -> builtins.list[NothingFits]:
        """"Nothing fits" records whose key starts with `prefix` and holds no plan, newest first; with `team`,
        the team directory's too (under keys without a record or plan here, or a plan there)."""
        prefix = prefix.lower()
        found = self._use("list 'nothing fits' records", lambda db: cache_db.all_nothing_fits(db, prefix), [])
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
        """Store `plan` (with its trials) under the key of `parts`, replacing what was there.

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
        self._use("save the plan", lambda db: cache_db.upsert(db, row, "tuned"), None)

    def replace(self, key: str, plan: Plan) -> None:
        """Store a new plan for a key already cached, keeping its parts (after a recovery mid-training)."""
        plan = plan.with_provenance(key=key)
        if not self._use("replace the plan", lambda db: cache_db.replace_plan(db, key, plan), 1):
            log.debug("plan cache: no plan under %s to replace", key[:12])

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
        self._use("record the failure", lambda db: cache_db.insert_failures(db, key, [failure]), None)

    def nothing_fits(self, key: str) -> NothingFits | None:
        """The record that an earlier search under `key` found no configuration that fits, or None.

        This cache's record, else (after a local miss) the team directory's; its `origin` says which:
        "search", "import:<file>" or "team:<dir>". None where a plan is stored for `key`, here or in the
        team directory: a plan is a configuration measured to fit, and beats a search that found none.
        """
        record, planned = self._use("read a 'nothing fits' record", lambda db: cache_db.nothing_fits(db, key),
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
        self._use("record that nothing fits", lambda db: cache_db.record_nothing_fits(db, row), None)
        return row.key

    def delete(self, key: str) -> bool:
        """Forget the plan and the failures under `key`; True if a plan was there."""
        return self._use("delete a plan", lambda db: cache_db.delete(db, key), False)

    def clear(self) -> int:
        """Forget every plan and failure; returns how many plans there were."""
        return self._use("clear the cache", cache_db.clear, 0)

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
        stored = self._use("import plans", lambda db: cache_db.import_rows(db, plans, refusals, origin), False)
        if not stored:
            return ImportReport(accepted=(), rejected=rejected)
        return ImportReport(accepted=tuple(r.key for r in plans), rejected=rejected,
                            nothing_fits=tuple(r.key for r in refusals))

    # -- the database, and what to do when it fails -------------------------------------------------------

    def _use(self, what: str, action: Callable[[Database], T], default: T) -> T:
        """Run `action` on the database; on trouble, report it once and return `default`.

        After a "corrupt" error the action runs once more on a new connection: to the same file when SQLite's
        integrity check finds it sound, to a new one when the damaged file was moved aside. Every action is
        one statement, one transaction or an idempotent insert, so running it twice stores nothing twice.
        """
        with self._lock:
            for attempt in range(2):
                db = self._database()
                if db is None:
                    return default
                try:
                    return action(db)
                except sqlite3.Error as exc:
                    if not self._trouble(exc, what, again=attempt == 0):
                        return default
            return default

    def _database(self) -> Database | None:
        if self._pid != os.getpid():  # forked: a SQLite connection must not cross fork(), so open our own
            self._db, self._pid = None, os.getpid()
        if self._db is None and self.problem is None:
            self._db = self._connect()
        return self._db

    def _connect(self) -> Database | None:
        for attempt in range(2):  # again after a corrupt file was moved aside, or a sound one met a "corrupt" error
            try:
                return cache_db.open_database(self.path, self.timeout)
            except cache_db.Unusable as exc:
                self._off(exc.problem, exc.detail)
                return None
            except (sqlite3.Error, OSError) as exc:
                if not self._trouble(exc, "open", again=attempt == 0):
                    return None
        self._off("io", "a new file could not be opened after moving the corrupt one aside")
        return None

    def _trouble(self, exc: BaseException, what: str, *, again: bool = False) -> bool:
        """Close the connection and deal with `exc`; True when the caller may try once more on a new connection.

        A "corrupt" error moves the file aside only when SQLite's integrity check finds it damaged; a sound
        file is kept, and (unless `again` is off) the caller tries again.
        """
        self.close()
        problem = cache_db.classify(exc, self.path)
        code = getattr(exc, "sqlite_errorname", "")  # Python 3.11+; says BUSY from BUSY_RECOVERY and the like
        detail = f"{what}: {exc}" + (f" [{code}]" if code else "")
        if problem == "corrupt":
            integrity = cache_db.check_integrity(self.path, self.timeout)
            if not integrity.damaged:
                if again:
                    log.debug("plan cache %s: %s, but SQLite finds the file sound (%s); trying again", self.path,
                              detail, integrity.detail)
                    return True
                problem = "io"
                detail += f"; SQLite finds the file sound ({integrity.detail}), so it is kept"
            else:
                detail += f"; {integrity.detail}"
                moved = cache_db.move_aside(self.path)
                if moved is not None:  # recovered: the next connection starts a new file
                    self._say("corrupt", f"{detail}; moved it aside to {moved.name} and started a new one",
                              warn=True)
                    return True
                detail += "; it is not ours to move (not an autotune cache by its header, another user's, not a " \
                          "regular file, or still open in this process), so it is left alone"
        self._off(problem, detail)
        return False

    def _off(self, problem: str, detail: str) -> None:
        self.problem = problem
        self._say(problem, detail, warn=not self.strict)

    def _say(self, problem: str, detail: str, *, warn: bool) -> None:
        message = cache_db.message(problem, self.path, detail, self.timeout)
        if not warn:
            raise CacheError(message)
        _warn_once(str(self.path), problem, message)

    def _team(self, read: Callable[[TeamDir], dict[str, T]]) -> dict[str, T]:
        """What `read` gets from the team directory; {} without one, or when it fails (said once)."""
        if self.team is None:
            return {}
        try:
            found = read(self.team)
        except Exception as exc:  # noqa: BLE001 - the team directory never fails a fit (DESIGN.md section 5)
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


def _warn_once(path: str, problem: str, message: str) -> None:
    """One warning per file and problem per process: a training loop calling `fit` often is not flooded."""
    if (path, problem) not in _warned:
        _warned.add((path, problem))
        warnings.warn(message, CacheWarning, stacklevel=5)


def _smallest(failures: tuple[Failure, ...]) -> int | None:
    return min((f.micro_batch_size for f in failures), default=None)


def _smaller(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)
