"""`autotune doctor` (not yet available)."""

from __future__ import annotations

import click


@click.command()
def doctor() -> None:
    """Report GPUs, drivers, host memory, torch/CUDA, bf16 support and cache health (not yet available).

    \b
    Example:
      autotune doctor
    """
    click.echo("autotune doctor: not yet available")
