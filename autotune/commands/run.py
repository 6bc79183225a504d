"""`autotune run SCRIPT ...` (not yet available)."""

from __future__ import annotations

import click


@click.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def run(script: str, script_args: tuple[str, ...]) -> None:
    """Wrap an existing training script: tune, launch, watch, restart after an OOM (not yet available).

    \b
    Example:
      autotune run train.py --epochs 3
    """
    click.echo("autotune run: not yet available")
