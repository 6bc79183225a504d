"""The plan cache's SQLite file: creating, claiming and migrating it, the statements, and what its errors mean.

Concurrency (PEERS.md lesson 11): WAL journal, a busy timeout, and every write is one statement (an
upsert) or one `BEGIN IMMEDIATE` transaction, which takes the write lock up front; never a deferred
read-modify-write, which fails with "database is locked" under concurrent writers. `PRAGMA user_version`
holds the schema version and `MIGRATIONS` bring an older file forward; `PRAGMA application_id` marks
the file as ours, so a database that belongs to something else is never written to.

SQLite's locks are POSIX record locks, which a process drops on *every* descriptor of a file when it closes
*any* one of them: a header read with `open()` while a connection of this process has the file open would
release that connection's locks, and another process could then checkpoint and delete the WAL under it
(its writes lost, its reads of a stale index failing as "malformed"). So the header is read only while no
connection opened here is open (`_held_here`), and "corrupt" is decided by SQLite's integrity check run
in a fresh process (`check_integrity`), never by the error one statement met.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shutil
import sqlite3
import stat
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
from sqlite_utils import Database

from .rows import CacheEntry, Failure, NothingFits, PlanRow
from ..evidence import Trial
from ..plan import Plan
from ..sizes import format_bytes

log = logging.getLogger(__name__)

SCHEMA_VERSION = 3  # 2: the nothing_fits table; 3: its origin column
APPLICATION_ID = 0x41545043  # "ATPC" in the SQLite header: this file is an autotune plan cache
SQLITE_MAGIC = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file
FULL_BELOW_BYTES = 2**20  # an I/O error with less free space than this on the cache's file system is "full"
CLOCK_SKEW = 60.0  # seconds a stored date may run ahead of this clock and still outrank a row written now
CACHE_ENV = "AUTOTUNE_CACHE"
TEAM_DIR_ENV = "AUTOTUNE_TEAM_DIR"
# SQLite's locking is unreliable on these ("WAL does not work over a network filesystem"); fuse covers
# sshfs, s3fs, gcsfuse and friends.
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb", "smb2", "smb3", "smbfs", "lustre", "gpfs", "fuse", "ceph",
                       "glusterfs", "beegfs", "afs")


class Unusable(Exception):
    """A database autotune will not use, for a reason that is not a SQLite error."""

    def __init__(self, problem: str, detail: str) -> None:
        super().__init__(detail)
        self.problem, self.detail = problem, detail


# -- opening, creating and migrating ---------------------------------------------------------------------------

def open_database(path: Path, timeout: float) -> Database:
    """Open the cache file, creating (0700 directory, 0600 file), claiming and migrating it as needed.

    Raises:
        Unusable: the file is on a network file system, belongs to something else, or is newer than us.
        sqlite3.Error, OSError: the file cannot be opened or read (see `classify`).
    """
    fstype = filesystem_type(path)
    if is_network_filesystem(fstype):
        raise Unusable("network", f"it is on {fstype}")
    with _open_lock:  # no other thread opens a connection between the header check and this one's registration
        if not _held_here(path):  # a file this process holds open was checked when it was opened
            _check_is_sqlite(path)
        _create_private(path)
        # check_same_thread off: PlanCache's lock serialises the threads sharing a connection.
        conn = sqlite3.connect(str(path), timeout=timeout, check_same_thread=False, factory=_Connection)
        _register(path, conn)
    try:
        db = Database(conn, execute_plugins=False)
        version = _check_header(db)
        _enable_wal(db, timeout)
        # In WAL mode NORMAL syncs at checkpoints, not at every commit: the file stays consistent, a power cut
        # may lose the last plans written, and the write lock is held for microseconds, not an fsync.
        db.execute("PRAGMA synchronous = NORMAL")
        if version < SCHEMA_VERSION:
            _migrate(db)
        return db
    except BaseException:
        conn.close()
        raise


class _Connection(sqlite3.Connection):
    """A connection that can be weakly referenced, so the registry of open files never keeps one alive."""


_open_lock = threading.Lock()
_open: dict[tuple[int, int], list[weakref.ref[_Connection]]] = {}  # (device, inode) -> connections opened here
os.register_at_fork(after_in_child=_open.clear)  # a forked child inherits no lock, so it holds no file open


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _register(path: Path, conn: _Connection) -> None:
    identity = _identity(path)
    if identity is not None:
        _open.setdefault(identity, []).append(weakref.ref(conn))


def _is_open(ref: weakref.ref[_Connection]) -> bool:
    conn = ref()
    if conn is None:
        return False
    try:
        conn.total_changes  # noqa: B018 - raises once the connection is closed
    except sqlite3.ProgrammingError:
        return False
    return True


def _held_here(path: Path) -> bool:
    """Whether a connection this process opened to the file at `path` (that very file, by inode) is still open."""
    identity = _identity(path)
    if identity is None:
        return False
    live = [ref for ref in _open.get(identity, ()) if _is_open(ref)]
    if live:
        _open[identity] = live
    else:
        _open.pop(identity, None)
    return bool(live)


def _check_is_sqlite(path: Path) -> None:
    """Refuse a file that is not SQLite (a user's text file, say): it is not ours to write, rename or replace.

    Raises:
        Unusable: ("foreign_file") naming what is there.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except FileNotFoundError:
        return
    except IsADirectoryError:
        raise Unusable("foreign_file", "it is a directory") from None
    except OSError:
        return  # unreadable: SQLite's own error says why, and classify() names it
    if head and head != SQLITE_MAGIC:
        raise Unusable("foreign_file", f"it is not a SQLite file (it starts with {head[:8]!r})")


def is_ours(path: Path) -> bool:
    """Whether the file at `path` is an autotune cache by its header (SQLite magic and our application_id),
    or an empty file (which autotune creates before SQLite writes the header)."""
    try:
        with open(path, "rb") as f:
            header = f.read(100)
    except OSError:
        return False
    return not header or (header.startswith(SQLITE_MAGIC) and header[68:72] == APPLICATION_ID.to_bytes(4, "big"))


def _create_private(path: Path) -> None:
    """Create missing directories (0700) and the file (0600); SQLite gives -wal/-shm the file's mode.

    Every directory made here is 0700, $XDG_CACHE_HOME included when it was missing: a cache reveals
    which models its user trains. An existing directory keeps its owner's choice.
    """
    missing = []
    directory = path.parent
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:  # another process made it first
            continue
        os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask
    if not path.exists():
        with contextlib.suppress(FileExistsError):  # another process created it first
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def _enable_wal(db: Database, timeout: float) -> None:
    """Switch a new file to WAL, retrying: SQLite answers "locked" at once here, without its busy handler,
    while another process opening the same new file holds a lock (seen with 16 processes opening at once)."""
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
    # One statement reads one snapshot: two reads could see the header before, and the tables after,
    # another process's first migration.
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
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute(f"PRAGMA application_id = {APPLICATION_ID}")


def _create_v1(db: Database) -> None:
    db["plans"].create({"key": str, "parts": str, "plan": str, "origin": str, "created": float, "updated": float},
                       pk="key", not_null=["parts", "plan"])
    db["failures"].create({"id": int, "key": str, "micro_batch_size": int, "shapes": str, "note": str,
                           "time": float}, pk="id", not_null=["key", "micro_batch_size"])
    # The same failure imported twice (or from two team files) is stored once.
    db["failures"].create_index(["key", "micro_batch_size", "time"], unique=True)


def _create_v2(db: Database) -> None:
    # A search that found nothing under its budget, so a retry (or a teammate's fit) answers at once.
    db["nothing_fits"].create({"key": str, "parts": str, "message": str, "trials": str, "time": float}, pk="key",
                              not_null=["parts", "message"])


def _add_origin_v3(db: Database) -> None:
    # Where a "nothing fits" record came from (a search here, an import), named when `fit` serves it.
    db.execute("ALTER TABLE nothing_fits ADD COLUMN origin TEXT")


# MIGRATIONS[v]: schema v to v + 1
MIGRATIONS: list[Callable[[Database], None]] = [_create_v1, _create_v2, _add_origin_v3]


@contextlib.contextmanager
def immediate(db: Database) -> Iterator[Database]:
    """A write transaction that takes the write lock up front, waiting up to the busy timeout for it."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
        db.execute("COMMIT")
    except BaseException:
        if db.conn.in_transaction:
            db.conn.execute("ROLLBACK")
        raise


# -- statements -------------------------------------------------------------------------------------------------

_UPSERT_PLAN = """
INSERT INTO plans (key, parts, plan, origin, created, updated)
VALUES (:key, :parts, :plan, :origin, :now, :updated)
ON CONFLICT(key) DO UPDATE SET parts = excluded.parts, plan = excluded.plan, origin = excluded.origin,
    updated = excluded.updated
WHERE excluded.updated >= plans.updated OR plans.updated > :latest
"""
_INSERT_FAILURE = """
INSERT OR IGNORE INTO failures (key, micro_batch_size, shapes, note, time)
VALUES (:key, :micro_batch_size, :shapes, :note, :time)
"""


def upsert(db: Database, row: PlanRow, origin: str) -> None:
    """Insert or replace a plan in one statement; an older row never overwrites a newer one (`updated`), and a
    stored row dated in the future (a clock set wrong, a date written unclamped) counts as older than any."""
    now = time.time()
    db.execute(_UPSERT_PLAN, {"key": row.key, "parts": json.dumps(row.parts, sort_keys=True),
                              "plan": json.dumps(row.plan.to_dict()), "origin": origin,
                              "now": max(now, row.updated), "updated": row.updated, "latest": now + CLOCK_SKEW})


def replace_plan(db: Database, key: str, plan: Plan) -> int:
    """Swap the plan under `key`, keeping its parts; returns 0 when no plan was there."""
    cursor = db.execute("UPDATE plans SET plan = ?, origin = 'replaced', updated = ? WHERE key = ?",
                        [json.dumps(plan.to_dict()), time.time(), key])
    return cursor.rowcount


def insert_failures(db: Database, key: str, failures: Iterable[Failure]) -> None:
    for f in failures:
        db.execute(_INSERT_FAILURE, {"key": key, "micro_batch_size": f.micro_batch_size, "note": f.note,
                                     "shapes": None if f.shapes is None else json.dumps(f.shapes), "time": f.time})


def import_rows(db: Database, plans: Iterable[PlanRow], refusals: Iterable[NothingFits], origin: str) -> bool:
    """Store validated rows in one transaction, plans (and their failures) first; True once committed."""
    with immediate(db):
        for row in plans:
            upsert(db, row, origin)
            insert_failures(db, row.key, row.failures)
        for refusal in refusals:
            db.execute(_IMPORT_NOTHING_FITS, {**_nothing_fits_params(refusal, origin),
                                              "latest": time.time() + CLOCK_SKEW})
    return True


# An imported "nothing fits" record is stored only where this cache holds no plan for its key and no newer
# record of its own. A plan is a configuration measured to fit, which beats a search that found none (a
# refusal would also hide it once an OOM in training marks the plan unsafe: the next search must then run,
# bounded below that OOM, not be refused). Between two refusals the newer one is kept: both say the same,
# and the newer message and trials describe the latest search; a stored one dated in the future is older.
_IMPORT_NOTHING_FITS = """
INSERT INTO nothing_fits (key, parts, message, trials, time, origin)
SELECT :key, :parts, :message, :trials, :time, :origin WHERE NOT EXISTS (SELECT 1 FROM plans WHERE key = :key)
ON CONFLICT(key) DO UPDATE SET parts = excluded.parts, message = excluded.message, trials = excluded.trials,
    time = excluded.time, origin = excluded.origin
WHERE excluded.time > nothing_fits.time OR nothing_fits.time > :latest
"""


def _nothing_fits_params(row: NothingFits, origin: str) -> dict[str, object]:
    return {"key": row.key, "parts": json.dumps(row.parts, sort_keys=True), "message": row.message,
            "trials": json.dumps([t.to_dict() for t in row.trials]), "time": row.time, "origin": origin}


def record_nothing_fits(db: Database, row: NothingFits) -> None:
    """Remember that nothing fits under `row.key` (one statement; a new search here replaces any record)."""
    db.execute("INSERT OR REPLACE INTO nothing_fits (key, parts, message, trials, time, origin) "
               "VALUES (:key, :parts, :message, :trials, :time, :origin)", _nothing_fits_params(row, "search"))


_NOTHING_FITS_COLUMNS = "key, parts, message, trials, time, origin"
_NO_PLAN = "NOT EXISTS (SELECT 1 FROM plans WHERE plans.key = nothing_fits.key)"  # a plan beats a refusal


def nothing_fits(db: Database, key: str) -> tuple[NothingFits | None, bool]:
    """(the record that nothing fits under `key`, whether a plan is stored under `key`), in one read.

    Where a plan is stored the record is None: a plan, safe or not, says something fits (see
    `_IMPORT_NOTHING_FITS`). An unreadable record is None too.
    """
    planned, *found = db.execute(
        f"SELECT EXISTS (SELECT 1 FROM plans WHERE key = :key), n.* FROM (SELECT 1) LEFT JOIN "
        f"(SELECT {_NOTHING_FITS_COLUMNS} FROM nothing_fits WHERE key = :key) AS n", {"key": key}).fetchone()
    if planned or found[0] is None:
        return None, bool(planned)
    return _load_nothing_fits(*found), False


def all_nothing_fits(db: Database, prefix: str = "") -> list[NothingFits]:
    """Every readable record under a key that starts with `prefix` and holds no plan, newest first (what an
    export shares, and `autotune cache list` shows)."""
    rows = db.execute(f"SELECT {_NOTHING_FITS_COLUMNS} FROM nothing_fits WHERE {_NO_PLAN} AND "
                      "substr(key, 1, length(:prefix)) = :prefix ORDER BY time DESC", {"prefix": prefix})
    return [record for record in (_load_nothing_fits(*row) for row in rows) if record is not None]


def _load_nothing_fits(key: str, parts: str, text: str, trials: str, when: float | None,
                       origin: str | None) -> NothingFits | None:
    try:
        return NothingFits(key=key, parts=_load_json(parts), message=text, origin=origin or "search",
                           trials=tuple(Trial.from_dict(t) for t in json.loads(trials or "[]")), time=when or 0.0)
    except (ValueError, TypeError) as exc:  # hand-edited or another format: never trusted, a miss
        log.debug("plan cache: ignoring unreadable 'nothing fits' record %s: %s", key[:12], exc)
        return None


def delete(db: Database, key: str) -> bool:
    with immediate(db):
        gone = db.execute("DELETE FROM plans WHERE key = ?", [key]).rowcount
        for table in ("failures", "nothing_fits"):
            db.execute(f"DELETE FROM {table} WHERE key = ?", [key])
    return gone > 0


def clear(db: Database) -> int:
    with immediate(db):
        gone = db.execute("DELETE FROM plans").rowcount
        for table in ("failures", "nothing_fits"):
            db.execute(f"DELETE FROM {table}")
    return gone


def local_plan(db: Database, key: str) -> tuple[Plan | None, int | None]:
    """The stored plan (None if absent or unreadable) and the smallest failing micro-batch, in one read."""
    plan_json, failing = db.execute(
        "SELECT (SELECT plan FROM plans WHERE key = :key), "
        "(SELECT MIN(micro_batch_size) FROM failures WHERE key = :key)", {"key": key}).fetchone()
    return (load_plan(plan_json, key) if plan_json else None), failing


def smallest_failure(db: Database, key: str) -> int | None:
    return db.execute("SELECT MIN(micro_batch_size) FROM failures WHERE key = ?", [key]).fetchone()[0]


def entries(db: Database, prefix: str) -> list[CacheEntry]:
    """Plans whose key starts with `prefix`, newest first, each with its failures."""
    where, params = "WHERE substr(key, 1, length(:prefix)) = :prefix", {"prefix": prefix}
    failures: dict[str, list[Failure]] = {}
    for key, micro, shapes, note, when in db.execute(
            f"SELECT key, micro_batch_size, shapes, note, time FROM failures {where} ORDER BY time", params):
        with contextlib.suppress(ValueError, TypeError):  # a hand-edited row is skipped, never trusted
            failures.setdefault(key, []).append(Failure(micro_batch_size=micro, note=note or "", time=when or 0.0,
                                                        shapes=json.loads(shapes) if shapes else None))
    rows = db.execute(f"SELECT key, parts, plan, origin, created, updated FROM plans {where} ORDER BY updated DESC",
                      params).fetchall()
    return [CacheEntry(key=key, parts=_load_json(parts), plan=load_plan(plan, key),
                       failures=tuple(failures.get(key, ())), created=created or 0.0, updated=updated or 0.0,
                       origin=origin or "") for key, parts, plan, origin, created, updated in rows]


def load_plan(text: str | None, key: str) -> Plan | None:
    """A stored plan, validated by `Plan.from_dict`; None (a miss) when it no longer validates."""
    try:
        return Plan.from_dict(json.loads(text or ""))
    except (ValueError, TypeError) as exc:  # another format, or hand-edited: never trusted
        log.debug("plan cache: ignoring unreadable plan %s: %s", key[:12], exc)
        return None


def _load_json(text: str | None) -> dict:
    with contextlib.suppress(ValueError, TypeError):
        value = json.loads(text or "")
        if isinstance(value, dict):
            return value
    return {}


# -- trouble ---------------------------------------------------------------------------------------------------

def classify(exc: BaseException, path: Path | None = None) -> str:
    """locked | corrupt | full | readonly | io, from a SQLite error's code (or message) or an OSError's errno.

    An I/O error on a file system with (almost) no free space left is "full": SQLite reports a full disk as
    SQLITE_IOERR_SHMSIZE when the -shm file cannot grow while opening, not as SQLITE_FULL.
    """
    problem = _classify(exc)
    if problem == "io" and path is not None and free_bytes(path) < FULL_BELOW_BYTES:
        return "full"
    return problem


def free_bytes(path: Path) -> int:
    """Free bytes on the file system holding `path` (its nearest existing ancestor); a large number if unknown."""
    target = Path(os.path.abspath(path))
    while not target.exists() and target != target.parent:
        target = target.parent
    try:
        return shutil.disk_usage(target).free
    except OSError:
        return 2**62


def _classify(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return {errno.ENOSPC: "full", errno.EDQUOT: "full", errno.EROFS: "readonly", errno.EACCES: "readonly",
                errno.EPERM: "readonly"}.get(exc.errno or 0, "io")
    name, text = getattr(exc, "sqlite_errorname", "") or "", str(exc).lower()  # errorname: Python 3.11+
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text:
        return "locked"
    if name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")) or "not a database" in text or "malformed" in text:
        return "corrupt"
    if name == "SQLITE_FULL" or "is full" in text:
        return "full"
    if name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")) or "readonly" in text \
            or "unable to open" in text:
        return "readonly"
    return "io"


_FIXES = {
    "locked": "another process held it past the {timeout:g} s busy timeout. If this repeats, find the holder "
              "(`fuser {path}`) or set {env} to another file",
    "corrupt": "the file is damaged",
    "full": "the disk (or the database's page limit) is full ({free} free on its file system). Free space, or "
            "drop old plans with `autotune cache clear`",
    "readonly": "it cannot be written here. Set {env} to a writable path, or pass cache=False; to share plans "
                "read-only, use {team} instead",
    "network": "SQLite's locking is unreliable on a network file system, so autotune will not use it there. "
               "Set {env} to a local disk path and share plans with `autotune cache export` / `import` or {team}",
    "newer": "it was written by a newer autotune. Upgrade autotune, or set {env} to another file",
    "foreign": "it is a SQLite database but not an autotune plan cache, so autotune leaves it alone. Set {env} "
               "to another file",
    "foreign_file": "autotune did not create it, so it leaves it alone and runs without a cache. Move the file "
                    "away, or set {env} to another path",
    "io": "the database failed. Run `autotune doctor`, or set {env} to another file",
}


def message(problem: str, path: Path, detail: str, timeout: float) -> str:
    """What went wrong with the cache at `path`, and the fix."""
    free = free_bytes(path) if problem == "full" else 0
    fix = _FIXES[problem].format(timeout=timeout, path=path, env=CACHE_ENV, team=TEAM_DIR_ENV,
                                 free=format_bytes(free) if free < 2**40 else "plenty")
    return f"plan cache {path} ({detail}): {fix}."


@dataclass(frozen=True, slots=True)
class Integrity:
    """SQLite's verdict on a database file: `damaged` only when its own check says so."""

    damaged: bool
    detail: str  # SQLite's first complaint, or why the check could not tell


# Run by `check_integrity` in a fresh interpreter, with nothing but the sqlite3 module; it opens the file as any
# connection does (not read-only, which would leave its -wal and -shm files behind) and writes nothing.
_INTEGRITY_SCRIPT = """
import sqlite3, sys
try:
    conn = sqlite3.connect(sys.argv[1], uri=True, timeout=float(sys.argv[2]))
    try:
        rows = [row[0] for row in conn.execute("PRAGMA integrity_check(1)")]
    finally:
        conn.close()
except sqlite3.DatabaseError as exc:
    name, text = getattr(exc, "sqlite_errorname", "") or "", str(exc)
    bad = name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")) or "malformed" in text or "not a database" in text
    print(("damaged " if bad else "unknown ") + text)
else:
    print("sound ok" if rows == ["ok"] else "damaged " + " ".join(" ".join(map(str, rows)).split()))
"""


def check_integrity(path: Path, timeout: float) -> Integrity:
    """Whether SQLite's `PRAGMA integrity_check` finds the file at `path` damaged.

    It runs in a fresh interpreter, whose view of the file is the file's own: this process's connections
    may share a stale WAL index (see the module docstring), which would fail any check run here. When the
    check cannot run or cannot tell (locked, unreadable), the file is not called damaged.
    """
    uri = Path(os.path.abspath(path)).as_uri() + "?mode=rw"  # rw: a missing file is not created
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _INTEGRITY_SCRIPT, uri, str(timeout)], capture_output=True,
                              text=True, timeout=timeout + 60, check=False)  # -I: no site or PYTHON* settings
    except (OSError, subprocess.SubprocessError) as exc:
        return Integrity(damaged=False, detail=f"the integrity check could not run: {exc}")
    verdict, _, detail = done.stdout.strip().partition(" ")
    if verdict not in ("sound", "damaged"):
        return Integrity(damaged=False, detail=f"the integrity check could not tell: {detail or done.stderr[-200:]}")
    return Integrity(damaged=verdict == "damaged", detail=f"integrity_check: {detail}")


def move_aside(path: Path) -> Path | None:
    """Rename our corrupt file (and its -wal / -shm) to `<name>.corrupt-<time>`; None if it is not ours.

    Ours: a regular file of this user whose header says autotune plan cache (`is_ours`). A file that
    merely fails to open as SQLite may be anybody's, and is never renamed. Nor is one that a connection
    of this process still holds open: reading its header would release that connection's locks.
    """
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        with _open_lock:
            if _held_here(path) or not is_ours(path):
                return None
        stamp = time.strftime("%Y%m%dT%H%M%S")
        target, n = path.with_name(f"{path.name}.corrupt-{stamp}"), 1
        while target.exists():  # two corruptions within a second keep both files
            target, n = path.with_name(f"{path.name}.corrupt-{stamp}-{n}"), n + 1
        os.rename(path, target)
        for suffix in ("-wal", "-shm"):  # a stale WAL would be replayed into the new file
            with contextlib.suppress(FileNotFoundError):
                os.rename(f"{path}{suffix}", f"{target}{suffix}")
        return target
    except OSError as exc:
        log.debug("plan cache: could not move %s aside: %s", path, exc)
        return None


def expanded(path: str | os.PathLike[str]) -> Path:
    """`path` with a leading `~` or `~user` expanded; as given when that home directory is unknown (the cache
    then runs without that file or team directory, see `unknown_home`)."""
    try:
        return Path(path).expanduser()
    except RuntimeError:  # pathlib's answer for an unknown user, or no $HOME
        return Path(path)


def unknown_home(path: Path) -> str | None:
    """The `~user` part of a path `expanded` could not expand, else None."""
    return path.parts[0] if path.parts and path.parts[0].startswith("~") else None


def filesystem_type(path: str | os.PathLike[str], mounts: Iterable[tuple[str, str]] | None = None) -> str:
    """The type of the file system holding `path` ("" when unknown): that of the deepest mount point above it.

    Args:
        path: a file or directory; it need not exist (its nearest existing ancestor is used).
        mounts: (mount point, type) pairs; default the system's, from psutil.
    """
    if mounts is None:
        try:
            mounts = [(p.mountpoint, p.fstype) for p in psutil.disk_partitions(all=True)]
        except (OSError, RuntimeError):
            return ""
    target = Path(os.path.abspath(path))
    while not target.exists() and target != target.parent:
        target = target.parent
    resolved = os.path.realpath(target)
    best, fstype = -1, ""
    for mountpoint, kind in mounts:
        inside = mountpoint == "/" or resolved == mountpoint or resolved.startswith(mountpoint.rstrip("/") + "/")
        if inside and len(mountpoint) > best:
            best, fstype = len(mountpoint), kind
    return fstype


def is_network_filesystem(fstype: str) -> bool:
    """True for nfs, cifs/smb, lustre, gpfs, fuse (any flavour) and the other network file systems above."""
    kind = fstype.lower()
    return kind.startswith("fuse") or kind.split(".")[0] in NETWORK_FILESYSTEMS
