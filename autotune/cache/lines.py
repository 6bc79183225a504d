"""Cache rows as JSON lines in a file: what `autotune cache export` writes and `import` and a team directory read.

Files come from teammates and may be damaged or hostile, so reading is bounded before parsing: a line is read
at most `MAX_LINE_BYTES` at a time (a longer one is skipped, never held whole) and must be UTF-8; each line is
then validated by `parse_row`. Each failure is a rejected row with its line number and reason; nothing a
file holds raises.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from .rows import MAX_LINE_BYTES, NothingFits, PlanRow, parse_row, printable

TEAM_FILE_GLOB = "*.jsonl"
_SKIP_CHUNK = 2**16  # bytes read at a time while skipping the rest of an over-long line


def read_rows(path: str | os.PathLike[str] | BinaryIO) -> Iterator[tuple[int, PlanRow | NothingFits | None, str]]:
    """Yield (line number, row or None, reason it was rejected) for each non-blank line of `path`.

    `path` may also be an open binary stream (standard input for `autotune cache import -`).

    A line is read at most `MAX_LINE_BYTES` at a time, so a huge line costs no more memory than that.
    Reasons are printable: control characters from the file are escaped (`printable`).

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") if isinstance(path, (str, os.PathLike)) else contextlib.nullcontext(path) as f:
        number = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            number += 1
            row, why = _parse_line(raw, f, first=number == 1)
            if row is None and not why:
                continue  # blank
            yield number, row, printable(why)


def _parse_line(raw: bytes, f: Any, *, first: bool) -> tuple[PlanRow | NothingFits | None, str]:
    """One line read by `read_rows`: (row, "") or (None, why); (None, "") for a blank line."""
    if len(raw) > MAX_LINE_BYTES:
        size = len(raw) + _skip_rest_of_line(f)
        return None, f"line is {size:,} bytes or more, over the {MAX_LINE_BYTES:,} a row may have"
    if first and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a UTF-8 byte order mark, as some editors save
    if not raw.strip():
        return None, ""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 (invalid byte {raw[exc.start]:#04x} at byte {exc.start + 1})"
    try:
        return parse_row(text), ""
    except ValueError as exc:
        return None, str(exc) or type(exc).__name__


def _skip_rest_of_line(f: Any) -> int:
    """Read past the end of the current line in small chunks; returns how many bytes were skipped."""
    skipped = 0
    while True:
        part = f.readline(_SKIP_CHUNK)
        skipped += len(part)
        if not part or part.endswith(b"\n"):
            return skipped


def write_rows(path: str | os.PathLike[str] | TextIO, rows: Iterable[PlanRow | NothingFits]) -> int:
    """Write rows as JSON lines, atomically (a reader never sees half a file); returns how many.

    `path` may also be an open text stream (standard output for `autotune cache export -`), written as is.
    """
    if not isinstance(path, (str, os.PathLike)):
        return sum(1 for row in rows if path.write(row.to_json() + "\n"))
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")  # same file system: atomic rename
    count = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(row.to_json() + "\n")
                count += 1
        os.chmod(tmp, 0o644)  # mkstemp made it 0600; an export is meant to be shared, unlike the database
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return count
