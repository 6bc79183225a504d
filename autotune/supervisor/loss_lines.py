"""The script's own loss lines, read as it prints them: a NaN or infinite loss in a zero-change run is told once.

A zero-change script knows nothing of autotune, so its loss is seen only where the script prints it:
`step 5  loss nan`, `loss: inf`, `{'loss': nan, ...}` (Hugging Face's Trainer), `train_loss=nan`. The
supervisor reads each line of the real run's output (`process.Child`'s `on_line`) and, at the first that
shows a loss that is not a finite number, says once what it means: training has diverged, and whether the
plan can be the cause. The run goes on as the script decides; the line is not repeated for later steps.
"""

from __future__ import annotations

import logging
import re
import threading

from ..plan import Plan
from ..sizes import shorten

log = logging.getLogger("autotune.supervisor.runner")  # the run's log, beside its other lines

# A word ending in "loss" (loss, train_loss, val_loss), an optional quote and ':' or '=', then NaN or an infinity,
# bare or as a printed tensor. "loss 0.31", "lossy", "loss inference" do not match.
NON_FINITE_LOSS = re.compile(
    r"(?<![a-z])loss['\"]?\s*[:=]?\s*(?:tensor\(\s*)?[-+]?(?:nan|inf(?:inity)?)\b", re.IGNORECASE)


def non_finite_loss(line: str) -> bool:
    """Whether `line` reports a loss that is NaN or infinite."""
    return NON_FINITE_LOSS.search(line) is not None


class LossWatch:
    """Reads a real run's output lines; at the first NaN or infinite loss, logs one warning naming what to check.

    Args:
        plan: the plan the script runs with (its flags), for whether its precision can be the cause.
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.seen: str | None = None  # the first line that showed it
        self._lock = threading.Lock()  # stdout and stderr are read on two threads

    def __call__(self, line: str) -> None:
        if self.seen is not None or not non_finite_loss(line):
            return
        with self._lock:
            if self.seen is not None:
                return
            self.seen = line.strip()
        log.warning("%s", self.message())

    def message(self) -> str:
        """What the run is told: the line, that training diverged, and what to check."""
        said = (f"the script reports a loss that is not a finite number ({shorten(self.seen or '', 120)!r}): its "
                "training has diverged.")
        # Of what a zero-change plan sets through the script's flags, only these change the loss's arithmetic.
        plan = self.plan
        suspects = [name for name, on in (("bf16", plan.precision == "bf16"), ("compile", plan.compile)) if on]
        if suspects:
            names = " and ".join(suspects)
            return (f"{said} The plan turns on {names} through the script's flags, which can overflow or change the "
                    f"arithmetic: if the script's own settings train without a NaN, rerun with {names} out of the "
                    "allowed techniques (e.g. AUTOTUNE_TECHNIQUES=checkpointing); else check the learning rate and "
                    "the data.")
        return (f"{said} The plan sets only how the batch is split and what is recomputed, which leaves the loss's "
                "arithmetic the script's own, so it is not the cause: check the learning rate, the data and the "
                "loss function.")
