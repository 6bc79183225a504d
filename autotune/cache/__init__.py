"""The plan cache: SQLite on the user's machine, JSON lines between teammates.

`store` (`PlanCache`: get, put, failures, the team directory) · `db` (the SQLite file: schema, WAL,
migrations, degrading to no cache) · `rows` (validation of rows from elsewhere, export and import) ·
`key` (what a plan is keyed by).
"""

from .store import PlanCache

__all__ = ["PlanCache"]
