"""`max_tune_seconds`: a bound on a tune's time, counted from fit's call.

Once the bound has passed, no new trial starts (`Deadline.guard` raises `OutOfTime` in its place): the search
picks from what it measured, the phases after the pick that have not run are skipped, and the plan's reason says
the search was cut short and how many configurations it left untried. A trial already running finishes, so a tune
returns within the bound plus one trial. Until one configuration has fitted, the bound does not stop the search:
a plan found late beats no plan, and the reason says the bound passed before the first fit.

Under torch.distributed the ranks agree whether the bound has passed (the earliest rank to see it decides for
all), so no rank starts a trial whose collectives another rank will never join.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import parallel as distributed
from ..configuration import Rung
from ..evidence import Trial


class OutOfTime(Exception):
    """Raised in place of a trial that would start after `max_tune_seconds`: the search stops and picks."""


@dataclass(kw_only=True)
class Deadline:
    """The bound on one tune: `seconds` (None: unbounded) from `started` (a `time.perf_counter` reading)."""

    seconds: float | None = None
    started: float = 0.0
    found: bool = False  # a trial of the search in progress fitted: from now on the bound may stop it
    cut: bool = False  # a trial was refused: the search was cut short
    late: bool = False  # a trial started after the bound because nothing had fitted yet

    def passed(self) -> bool:
        """Whether the bound has passed, agreed over the ranks."""
        if self.seconds is None:
            return False
        over = time.perf_counter() - self.started >= self.seconds
        return distributed.smallest(0 if over else 1) == 0

    def begin_search(self) -> None:
        """A new search over its own configurations (sharded, or in FP32 after 16 bits failed): it has found
        nothing yet."""
        self.found = False

    def guard(self, runner: Callable[..., Trial]) -> Callable[..., Trial]:
        """`runner`, refusing to start a trial once the bound has passed and a trial of this search fitted."""
        if self.seconds is None:
            return runner

        def run(rung: Rung, micro: int, **kwargs: Any) -> Trial:
            if self.passed():
                if self.found:
                    self.cut = True
                    raise OutOfTime
                self.late = True
            trial = runner(rung, micro, **kwargs)
            self.found = self.found or trial.fits
            return trial

        return run

    def clause(self, cut: bool, trials: int, untried: int) -> str:
        """What a plan's reason says of the bound: its search `cut` short (after `trials`, with `untried`
        configurations left), or the bound passed before the first fit; "" otherwise."""
        if self.seconds is None:
            return ""
        bound = f"max_tune_seconds={self.seconds:g}"
        late = " (it passed before any configuration fitted: the search went on to the first that did)"
        if cut:
            return (f"search cut short at {bound}{late if self.late else ''} after {trials} trial(s): {untried} "
                    "configuration(s) it had lined up left untried, so a longer tune may find a faster plan")
        return f"{bound}{late}" if self.late else ""
