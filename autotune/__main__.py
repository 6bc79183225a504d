"""`python -m autotune ...`: the same as the `autotune` command."""

from .cli import main

main(prog_name="autotune")
