"""The `autotune` command line: a click group whose commands live one per module in `commands/`.

Each command parses its options, makes one library call, and maps autotune's errors to exit codes:
0 success, 2 usage error, 3 no configuration fits, 4 environment error (no GPU where one is needed).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TextIO

import click

from .. import __version__
from ..cache.store import CacheWarning
from .cache import cache
from .doctor import doctor
from .plot import plot
from .run import run


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="autotune")
def main() -> None:
    """Make PyTorch training jobs fit in GPU memory and run fast.

    \b
    Examples:
      autotune run train.py --epochs 3          tune, then train with the plan (restarts after an OOM)
      autotune run --map micro_batch=--per_device_train_batch_size train_hf.py
      autotune cache list                       plans cached for this user
      autotune doctor                           GPUs, drivers, bf16 support, cache health
      autotune plot --output search.png         what the newest search tried, drawn
    """
    click.get_current_context().call_on_close(plain_cache_warnings())


def plain_cache_warnings() -> Callable[[], None]:
    """Show the plan cache's warnings as one "autotune: warning: ..." line on stderr, not in Python's warning
    format with a source line; other warnings as before. Returns the function that puts the old display back.
    """
    before = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        if issubclass(category, CacheWarning):
            click.echo(f"autotune: warning: {message}", err=True)
        else:
            before(message, category, filename, lineno, file, line)

    def restore(*_: Any) -> None:
        warnings.showwarning = before

    warnings.showwarning = show
    return restore


main.add_command(run)
main.add_command(cache)
main.add_command(doctor)
main.add_command(plot)
