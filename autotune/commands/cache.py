"""`autotune cache ...` (not yet available: arrives with the plan cache)."""

from __future__ import annotations

import click


@click.group()
def cache() -> None:
    """Inspect and share cached plans (not yet available).

    \b
    Example:
      autotune cache list
    """
