"""What a SQLite or OS error on the cache file means, what to tell the user, and whether the file is damaged.

"Corrupt" is decided by SQLite's integrity check run in a fresh process (`check_integrity`), never by the
error one statement met: this process's connections may share a stale WAL index (see `files`).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..sizes import format_bytes
from .files import CACHE_ENV, TEAM_DIR_ENV, free_bytes

FULL_BELOW_BYTES = 2**20  # an I/O error with less free space than this on the cache's file system is "full"


def classify(exc: BaseException, path: Path | None = None) -> str:
    """locked | corrupt | full | readonly | io, from a SQLite error's code (or message) or an OSError's errno.

    An I/O error on a file system with (almost) no free space left is "full": SQLite reports a full disk as
    SQLITE_IOERR_SHMSIZE when the -shm file cannot grow while opening, not as SQLITE_FULL.
    """
    problem = _classify(exc)
    if problem == "io" and path is not None and free_bytes(path) < FULL_BELOW_BYTES:
        return "full"
    return problem


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
