"""One guarded connection to the cache file: what to do when the database fails, and how that is said.

The cache never breaks training. A locked (past the timeout), corrupt, unwritable or full database, or
one on a network file system, gives one `CacheWarning`, and the cache carries on without its database
(a corrupt file of ours is first moved aside as `plans.db.corrupt-<time>` and a new one started).
With `strict=True` (the CLI) those raise `CacheError`, naming the fix.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlite_utils import Database

from ..errors import AutotuneError
from . import db as cache_db
from . import files, trouble
from .files import unknown_home

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_TIMEOUT = 10.0  # seconds a statement waits for another process's lock before giving up (then: no cache)


class CacheWarning(UserWarning):
    """The plan cache is unusable for now; autotune carries on without it."""


class CacheError(AutotuneError):
    """The plan cache is unusable (raised only with `strict=True`, as the CLI uses it); the message says why."""


_warned: set[tuple[str, str]] = set()  # (path, problem) already reported in this process


class CacheConnection:
    """The cache file's one SQLite connection, shared by threads one statement at a time, and its trouble."""

    def __init__(self, path: Path, *, timeout: float = DEFAULT_TIMEOUT, strict: bool = False) -> None:
        self.path = path
        self.timeout = float(timeout)
        self.strict = strict
        self.problem: str | None = None  # why the database is off ("locked", "corrupt"...), once it is
        self._db: Database | None = None
        self._pid = os.getpid()
        self._lock = threading.RLock()  # one connection, shared by threads one statement at a time
        home = unknown_home(self.path)
        if home is not None:  # never a directory literally named "~user" in the working directory
            self._off("readonly", f"no home directory is known for {home}")
        with self._lock:
            self._database()

    def __getstate__(self) -> dict[str, Any]:
        """A copy (pickle, `copy.deepcopy`) holds the path and settings, never the connection: it opens its own
        when first used, as after a fork."""
        state = dict(self.__dict__)
        state["_db"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

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

    # -- the database, and what to do when it fails -------------------------------------------------------

    def _use(self, what: str, action: Callable[[Database], T], default: Any) -> T:
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
            except files.Unusable as exc:
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
        problem = trouble.classify(exc, self.path)
        code = getattr(exc, "sqlite_errorname", "")  # Python 3.11+; says BUSY from BUSY_RECOVERY and the like
        detail = f"{what}: {exc}" + (f" [{code}]" if code else "")
        if problem == "corrupt":
            integrity = trouble.check_integrity(self.path, self.timeout)
            if not integrity.damaged:
                if again:
                    log.debug("plan cache %s: %s, but SQLite finds the file sound (%s); trying again", self.path,
                              detail, integrity.detail)
                    return True
                problem = "io"
                detail += f"; SQLite finds the file sound ({integrity.detail}), so it is kept"
            else:
                detail += f"; {integrity.detail}"
                moved = files.move_aside(self.path)
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
        message = trouble.message(problem, self.path, detail, self.timeout)
        if not warn:
            raise CacheError(message)
        _warn_once(str(self.path), problem, message)


def _warn_once(path: str, problem: str, message: str) -> None:
    """One warning per file and problem per process: a training loop calling `fit` often is not flooded."""
    if (path, problem) not in _warned:
        _warned.add((path, problem))
        warnings.warn(message, CacheWarning, stacklevel=5)
