"""The team directory: teammates' exports (`$AUTOTUNE_TEAM_DIR/*.jsonl`), read after a local miss, never written.

Each file is read with `read_rows`, so every row is validated as an import validates it; a file that
cannot be read, or that holds rejected rows, is skipped or partly used, and said once in `problems`.
"""

from __future__ import annotations

import dataclasses
import os

from .files import expanded, unknown_home
from .lines import TEAM_FILE_GLOB, read_rows
from .rows import NothingFits, PlanRow


class TeamDir:
    """Rows from a read-only directory of exports, loaded on first use.

    Several plan rows for one key merge: the newest plan wins, and every failure seen by anyone is kept.
    Several "nothing fits" rows for one key: the newest search wins (they say the same; its message and
    trials are the latest).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = expanded(path)
        self.problems: list[str] = []  # one line per unreadable file or file with rejected rows
        self._rows: dict[str, PlanRow] | None = None
        self._nothing_fits: dict[str, NothingFits] = {}

    @property
    def origin(self) -> str:
        """How a row from here is labelled: "team:<dir>"."""
        return f"team:{self.path}"

    def rows(self) -> dict[str, PlanRow]:
        """Every valid plan row, by key."""
        if self._rows is None:
            self._rows = self._load()
        return self._rows

    def nothing_fits(self) -> dict[str, NothingFits]:
        """Every valid "nothing fits" record, by key, each with origin "team:<dir>"."""
        self.rows()
        return self._nothing_fits

    def forget(self) -> None:
        """Treat the directory as empty from now on (after it failed in a way `_load` did not expect)."""
        self._rows, self._nothing_fits = {}, {}

    def _load(self) -> dict[str, PlanRow]:
        merged: dict[str, PlanRow] = {}
        home = unknown_home(self.path)
        if home is not None:  # never a directory literally named "~user" in the working directory
            self.problems.append(f"team directory {self.path} ($AUTOTUNE_TEAM_DIR) skipped: no home directory is "
                                 f"known for {home}")
            return merged
        try:
            files = sorted(self.path.glob(TEAM_FILE_GLOB)) if self.path.is_dir() else None
        except OSError as exc:
            files, detail = None, f": {exc.strerror}"
        else:
            detail = ""
        if files is None:
            self.problems.append(f"team directory {self.path} ($AUTOTUNE_TEAM_DIR) is not a readable directory"
                                 f"{detail}")
            return merged
        for file in files:
            try:
                results = list(read_rows(file))
            except OSError as exc:  # a directory named *.jsonl, no permission, an I/O error: skip the file
                self.problems.append(f"skipped team file {file}: cannot read it ({exc.strerror or exc})")
                continue
            rejected = [(n, why) for n, row, why in results if row is None]
            if rejected:
                n, why = rejected[0]
                self.problems.append(f"{len(rejected)} row(s) of team file {file} rejected (line {n}: {why}); "
                                     f"see all with `autotune cache import {file}`")
            for _, row, _ in results:
                if isinstance(row, PlanRow):
                    merged[row.key] = _merge(merged.get(row.key), row)
                elif isinstance(row, NothingFits):
                    self._keep_newest(row)
        return merged

    def _keep_newest(self, row: NothingFits) -> None:
        old = self._nothing_fits.get(row.key)
        if old is None or row.time >= old.time:
            self._nothing_fits[row.key] = dataclasses.replace(row, origin=self.origin)


def _merge(old: PlanRow | None, new: PlanRow) -> PlanRow:
    if old is None:
        return new
    newest = new if new.updated >= old.updated else old
    seen = {(f.micro_batch_size, f.time, f.note): f for f in old.failures + new.failures}  # de-duplicated
    failures = tuple(seen.values())
    return dataclasses.replace(newest, failures=failures)
