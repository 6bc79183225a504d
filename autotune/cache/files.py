"""The cache file on disk: where it is, what file system holds it, whether it is ours, and which files this
process holds open.

SQLite's locks are POSIX record locks, which a process drops on *every* descriptor of a file when it closes
*any* one of them: a header read with `open()` while a connection of this process has the file open would
release that connection's locks, and another process could then checkpoint and delete the WAL under it
(its writes lost, its reads of a stale index failing as "malformed"). So the header is read only while no
connection opened here is open (`held_here`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import stat
import threading
import time
import weakref
from collections.abc import Iterable
from pathlib import Path

import psutil

from .. import settings

log = logging.getLogger(__name__)

APPLICATION_ID = 0x41545043  # "ATPC" in the SQLite header: this file is an autotune plan cache
SQLITE_MAGIC = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file
CACHE_ENV = settings.ENV["cache"]
TEAM_DIR_ENV = settings.TEAM_DIR_ENV
# SQLite's locking is unreliable on these ("WAL does not work over a network filesystem"); fuse covers
# sshfs, s3fs, gcsfuse and friends.
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb", "smb2", "smb3", "smbfs", "lustre", "gpfs", "fuse", "ceph",
                       "glusterfs", "beegfs", "afs")


class Unusable(Exception):
    """A database autotune will not use, for a reason that is not a SQLite error."""

    def __init__(self, problem: str, detail: str) -> None:
        super().__init__(detail)
        self.problem, self.detail = problem, detail


class Connection(sqlite3.Connection):
    """A connection that can be weakly referenced, so the registry of open files never keeps one alive."""


open_lock = threading.Lock()
_open: dict[tuple[int, int], list[weakref.ref[Connection]]] = {}  # (device, inode) -> connections opened here
os.register_at_fork(after_in_child=_open.clear)  # a forked child inherits no lock, so it holds no file open


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def register(path: Path, conn: Connection) -> None:
    identity = _identity(path)
    if identity is not None:
        _open.setdefault(identity, []).append(weakref.ref(conn))


def _is_open(ref: weakref.ref[Connection]) -> bool:
    conn = ref()
    if conn is None:
        return False
    try:
        conn.total_changes  # noqa: B018 - raises once the connection is closed
    except sqlite3.ProgrammingError:
        return False
    return True


def held_here(path: Path) -> bool:
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


def check_is_sqlite(path: Path) -> None:
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


def create_private(path: Path) -> None:
    """Create missing directories (0700) and the file (0600); SQLite gives -wal/-shm the file's mode.

    Every directory made here is 0700, $XDG_CACHE_HOME included when it was missing: a cache reveals
    which models its user trains. An existing directory keeps its owner's choice. Where `path` is a symlink
    (dangling, or through linked directories), the file and directories are made where it points: that is the
    file SQLite opens, and would otherwise create with its own default mode.
    """
    path = Path(os.path.realpath(path))
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
        with open_lock:
            if held_here(path) or not is_ours(path):
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


def free_bytes(path: Path) -> int:
    """Free bytes on the file system holding `path` (its nearest existing ancestor); a large number if unknown."""
    target = Path(os.path.abspath(path))
    while not target.exists() and target != target.parent:
        target = target.parent
    try:
        return shutil.disk_usage(target).free
    except OSError:
        return 2**62


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
