"""One module per `autotune` subcommand; `autotune.cli` assembles them."""
