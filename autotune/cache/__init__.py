"""The plan cache: SQLite on the user's machine, JSON lines between teammates.

`store` (`PlanCache`: get, put, failures, the team directory) · `guard` (the one connection, and carrying on
without it when the database fails) · `tables` (the reads and writes) · `db` (opening, schema, migrations,
the write lock) · `files` (the file on disk, its file system) · `trouble` (what an error means, the fix) ·
`rows` (validation of rows from elsewhere) · `lines` (export and import as JSON lines) · `team` (a team's
exports, read-only) · `key` (what a plan is keyed by).
"""

from .store import PlanCache

__all__ = ["PlanCache"]
