"""Fails for a reason that is not memory: `autotune run` must pass exit code 7 through and not retry."""

import os
import sys

with open(sys.argv[1], "a") as log:  # one line per launch, so the test can count them
    log.write(f"launch {os.environ.get('AUTOTUNE_RESTART_COUNT')}\n")
print("Traceback (most recent call last):\nValueError: bad learning rate schedule", file=sys.stderr)
sys.exit(7)
