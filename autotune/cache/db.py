"""The plan cache's SQLite file: opening, claiming and migrating it, and the write transaction.

Concurrency: WAL journal, a busy timeout, and every write runs in one `BEGIN IMMEDIATE` transaction
(`immediate`), which takes the write lock up front; never a deferred read-modify-write, which fails with
"database is locked" under concurrent writers. `PRAGMA user_version` holds the schema version and
`MIGRATIONS` bring an older file forward; `PRAGMA application_id` marks the file as ours, so a database
that belongs to something else is never written to. Tables are created and altered through sqlite-utils.
"""

from __future__ import annotations

import contextlib
import random
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from sqlite_utils import Database

from . import files
from .files import APPLICATION_ID, Unusable
from .trouble import classify

SCHEMA_VERSION = 3  # 2: the nothing_fits table; 3: its origin column


def open_database(path: Path, timeout: float) -> Database:
    """Open the cache file, creating (0700 directory, 0600 file), claiming and migrating it as needed.

    Raises:
        Unusable: the file is on a network file system, belongs to something else, or is newer than us.
        sqlite3.Error, OSError: the file cannot be opened or read (see `trouble.classify`).
    """
    fstype = files.filesystem_type(path)
    if files.is_network_filesystem(fstype):
        raise Unusable("network", f"it is on {fstype}")
    with files.open_lock:  # no other thread opens a connection between the header check and its registration
        if not files.held_here(path):  # a file this process holds open was checked when it was opened
            files.check_is_sqlite(path)
        files.create_private(path)
        # check_same_thread off: PlanCache's lock serialises the threads sharing a connection.
        conn = sqlite3.connect(str(path), timeout=timeout, check_same_thread=False, factory=files.Connection)
        files.register(path, conn)
    try:
        db = Database(conn, execute_plugins=False)
        version = _check_header(db)
        _enable_wal(db, timeout)
        # In WAL mode NORMAL syncs at checkpoints, not at every commit: the file stays consistent, a power cut
        # may lose the last plans written, and the write lock is held for microseconds, not an fsync.
        db.execute("PRAGMA synchronous = NORMAL")  # raw SQL: sqlite-utils has no API for this pragma
        if version < SCHEMA_VERSION:
            _migrate(db)
        return db
    except BaseException:
        conn.close()
        raise


def _enable_wal(db: Database, timeout: float) -> None:
    """Switch a new file to WAL, retrying: SQLite answers "locked" at once here, without its busy handler,
    while another process opening the same new file holds a lock (many processes opening it at once)."""
    deadline = time.monotonic() + timeout
    while db.journal_mode != "wal":
        try:
            db.enable_wal()
        except sqlite3.OperationalError as exc:
            if classify(exc) != "locked" or time.monotonic() > deadline:
                raise
            time.sleep(random.uniform(0.005, 0.05))  # jitter, so the openers do not retry in step


def _check_header(db: Database) -> int:
    """The file's schema version, once its header says it is ours (or an empty file, ours to claim).

    Raises:
        Unusable: the file belongs to something else, or to a newer autotune.
    """
    # Raw SQL: one statement reads one snapshot, where two reads could see the header before, and the tables
    # after, another process's first migration; sqlite-utils has no API for these pragmas.
    app_id, version, tables = db.execute(
        "SELECT (SELECT application_id FROM pragma_application_id()), (SELECT user_version FROM "
        "pragma_user_version()), (SELECT count(*) FROM sqlite_master WHERE type = 'table')").fetchone()
    if app_id != APPLICATION_ID and (app_id or tables):
        names = ", ".join(db.table_names()[:5])
        raise Unusable("foreign", f"it holds tables {names}" if names else f"its application_id is {app_id:#x}")
    if version > SCHEMA_VERSION:
        raise Unusable("newer", f"its schema version is {version}, this autotune reads up to {SCHEMA_VERSION}")
    return version


def _migrate(db: Database) -> None:
    with immediate(db):
        version = _check_header(db)  # again, under the write lock: another process may have migrated meanwhile
        for step in range(version, SCHEMA_VERSION):
            MIGRATIONS[step](db)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")  # raw SQL: no sqlite-utils API for the header
        db.execute(f"PRAGMA application_id = {APPLICATION_ID}")


def _create_v1(db: Database) -> None:
    db.table("plans").create({"key": str, "parts": str, "plan": str, "origin": str, "created": float, "updated": float},
                       pk="key", not_null=["parts", "plan"], if_not_exists=True)
    db.table("failures").create({"id": int, "key": str, "micro_batch_size": int, "shapes": str, "note": str,
                           "time": float}, pk="id", not_null=["key", "micro_batch_size"], if_not_exists=True)
    # The same failure imported twice (or from two team files) is stored once.
    db.table("failures").create_index(["key", "micro_batch_size", "time"], unique=True, if_not_exists=True)


def _create_v2(db: Database) -> None:
    # A search that found nothing under its budget, so a retry (or a teammate's fit) answers at once.
    db.table("nothing_fits").create({"key": str, "parts": str, "message": str, "trials": str, "time": float}, pk="key",
                              not_null=["parts", "message"], if_not_exists=True)


def _add_origin_v3(db: Database) -> None:
    # Where a "nothing fits" record came from (a search here, an import), named when `fit` serves it.
    db.table("nothing_fits").add_column("origin", str)


# MIGRATIONS[v]: schema v to v + 1
MIGRATIONS: list[Callable[[Database], None]] = [_create_v1, _create_v2, _add_origin_v3]


@contextlib.contextmanager
def immediate(db: Database) -> Iterator[Database]:
    """A write transaction that takes the write lock up front, waiting up to the busy timeout for it.

    Raw SQL: sqlite-utils' `atomic()` begins a deferred transaction, whose first write after a read fails at
    once under a concurrent writer; sqlite-utils' writes inside this one nest as savepoints.
    """
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
        db.execute("COMMIT")
    except BaseException:
        if db.conn.in_transaction:
            db.conn.execute("ROLLBACK")
        raise
