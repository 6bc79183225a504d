"""The `autotune` command line: a click group whose commands live one per module in `commands/`.

Each command parses its options, makes one library call, and maps autotune's errors to exit codes:
0 success, 2 usage error, 3 no configuration fits, 4 environment error (no GPU where one is needed).
"""

from __future__ import annotations

import click

from .. import __version__
from ..supervisor.agent import plain_cache_warnings
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


main.add_command(run)
main.add_command(cache)
main.add_command(doctor)
main.add_command(plot)
