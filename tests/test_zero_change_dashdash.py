"""Zero-change flags around a bare `--`: the plan's flags reach the script's parser, positionals stay positionals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from autotune.configuration import Rung
from autotune.supervisor.flags import FlagMap

SCRIPT = Path(__file__).resolve().parent / "scripts" / "parsed_args.py"
FLAGS = FlagMap.parse(["micro_batch=--per_device_train_batch_size", "accumulation=--gradient_accumulation_steps",
                       "bf16=--bf16"])


def parsed(args: list[str]) -> dict:
    """What the script's own argparse makes of `args`."""
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_the_plans_flags_go_before_a_bare_double_dash_and_the_script_trains_with_them() -> None:
    # After `--` a parser reads positionals only: a mapped flag there would be a file name, not the batch.
    user = ["--lr", "3e-4", "--per_device_train_batch_size", "64", "--", "train.txt",
            "--per_device_train_batch_size"]
    args = FLAGS.apply(user, micro=8, accumulation=4, rung=Rung(precision="bf16"))
    seen = parsed(args)
    assert (seen["per_device_train_batch_size"], seen["gradient_accumulation_steps"], seen["bf16"]) == (8, 4, True)
    assert seen["lr"] == 3e-4
    assert seen["files"] == ["train.txt", "--per_device_train_batch_size"]  # the user's positionals, untouched


def test_the_global_batch_and_the_cache_key_read_flags_before_a_bare_double_dash_only() -> None:
    user = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--",
            "--gradient_accumulation_steps", "100"]
    assert FLAGS.global_batch(user, world_size=2) == 16
    assert FLAGS.unmapped(user) == ["--", "--gradient_accumulation_steps", "100"]
