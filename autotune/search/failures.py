"""Trials that fail for a reason other than memory: a configuration that raises (a kernel this device lacks in
bf16, compile's tracing) or a loss that is NaN or infinite. Such a trial is recorded with its reason and the
search goes on without the configuration; `fit` fails only where every configuration did, and then with the
failure itself: the model's own exception, untouched, where every configuration raised the same one; an
`InvalidSetting` naming the example batch where every loss was NaN or infinite.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import AutotuneError, InvalidSetting, NoFeasiblePlan
from ..evidence import Trial
from ..sizes import shorten

FAILED = ("error", "non_finite")  # the outcomes of a trial that failed for a reason other than memory
NAMED = 4  # configurations named per failure in a message; the rest are counted


class NonFiniteLoss(Exception):
    """A trial's loss was NaN or infinite (internal: the trial records it as its outcome "non_finite")."""


class LossCheck:
    """Whether every loss of a trial's steps was finite. Each step adds its loss (kept on the device: no step
    waits for it); `check` reads them all at once, between the timed steps."""

    def __init__(self) -> None:
        self._losses: list[torch.Tensor] = []

    def add(self, loss: Any) -> None:
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach().float().reshape(-1))

    def check(self, steps: str) -> None:
        """Raises `NonFiniteLoss` when a loss added since the last check was NaN or infinite; `steps` says which
        steps those were, for the trial's note."""
        if not self._losses:
            return
        values, self._losses = torch.cat(self._losses), []
        bad = ~torch.isfinite(values)
        if bool(bad.any()):
            raise NonFiniteLoss(f"loss {values[bad][0].item()} on the example batch ({steps})")


def kept(exc: BaseException) -> BaseException:
    """`exc`, as a trial caught it, made fit to keep until the search ends: its traceback less the trial's own
    frame (still running), and the locals of the frames it passed through cleared. A traceback keeps its
    frames' locals, the failed step's activations among them, alive while it lives (pytorch #27600); the
    cleared frames keep their lines, so the traceback a re-raise prints still shows where it was raised."""
    tb = exc.__traceback__
    exc.__traceback__ = tb.tb_next if tb is not None else None
    seen: set[int] = set()
    chained: BaseException | None = exc
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        if chained.__traceback__ is not None:
            traceback.clear_frames(chained.__traceback__)
        chained = chained.__cause__ or chained.__context__
    return exc


@dataclass(kw_only=True)
class Failures:
    """The trials of one `fit` that failed for a reason other than memory, by reason (an error's first line,
    or the non-finite loss), and the first exception each error raised, kept to be raised again."""

    trials: dict[str, list[Trial]] = field(default_factory=dict)
    raised: dict[str, BaseException] = field(default_factory=dict)

    def record(self, trial: Trial, reason: str, exc: BaseException | None) -> None:
        """`trial` failed (outcome "error" or "non_finite") for `reason`; `exc` is the error, `kept`."""
        self.trials.setdefault(reason, []).append(trial)
        if exc is not None and trial.outcome == "error":
            self.raised.setdefault(reason, exc)

    def fp32_instead(self, trials: Iterable[Trial]) -> str | None:
        """Why the search goes on in fp32, where the 16-bit search found nothing and some of its configurations
        failed for a reason other than memory (a kernel this device lacks in 16 bits, a loss that overflows);
        None where none did, or it ran in fp32 already."""
        ran = list(trials)
        if not ran or any(t.rung.precision == "fp32" for t in ran):
            return None
        failed = [t for t in ran if t.outcome in FAILED]
        if not failed:
            return None
        return (f"{failed[0].rung.precision} failed in {len(failed)} of the {len(ran)} configurations tried "
                f"({self._reasons(failed)}) and none fitted, so the search went on in fp32")

    def clause(self, precision: str) -> str:
        """A clause for the reason of a plan in `precision`: the configurations of that precision left out after
        failing (compile's failures have their own), or ""."""
        failed = [t for ts in self.trials.values() for t in ts if t.rung.precision == precision and not t.rung.compile]
        return f"left out after failing: {self._reasons(failed)}" if failed else ""

    def error_for(self, nothing: NoFeasiblePlan) -> BaseException:
        """What `fit` raises when the search found no plan: `nothing` itself where no trial failed for a reason
        other than memory; the model's own exception where every configuration raised the same one; an
        `InvalidSetting` naming the example batch where every loss was NaN or infinite; else an
        `AutotuneError` naming each distinct failure (never a `NoFeasiblePlan`, which the cache would keep as
        a verdict on memory)."""
        trials = list(nothing.trials)
        failed = [t for t in trials if t.outcome in FAILED]
        if not failed:
            return nothing
        if len(failed) == len(trials) and all(t.outcome == "non_finite" for t in failed):
            return InvalidSetting(
                f"the loss was NaN or infinite on the example batch in every configuration tried "
                f"({self._reasons(failed)}): check the example batch (fit's `batch`) for NaN or infinite values, "
                "and the model's initialisation (weights that are NaN or overflow); nothing was tuned or cached")
        if len(failed) == len(trials) and len(self.raised) == 1 and len(self.trials) == 1:
            return next(iter(self.raised.values()))  # the model's own error: every configuration raised it
        others = (f". The other configurations did not fit: {nothing}" if len(failed) < len(trials) else "")
        return AutotuneError(
            f"no configuration could train the model; {len(self._by_reason(failed))} distinct failure(s), each with "
            f"the configurations it ended: {self._reasons(failed)}{others}. Fix what the error names (the model, "
            "its inputs, the environment), or leave out the techniques whose configurations fail (fit's "
            "techniques=...)")

    def _by_reason(self, failed: list[Trial]) -> dict[str, list[Trial]]:
        """`failed` grouped by reason, in the order first seen (a trial failed on another rank: by its note)."""
        reason_of = {t: reason for reason, ts in self.trials.items() for t in ts}
        grouped: dict[str, list[Trial]] = {}
        for t in failed:
            grouped.setdefault(reason_of.get(t, t.note or t.outcome), []).append(t)
        return grouped

    def _reasons(self, failed: list[Trial]) -> str:
        """Each distinct reason among `failed`, with the configurations it ended."""
        parts = []
        for reason, ts in self._by_reason(failed).items():
            names = [f"{t.rung.name} @ {t.micro_batch_size}" for t in ts]
            more = f" and {len(names) - NAMED} more" if len(names) > NAMED else ""
            parts.append(f"{shorten(reason, 200)} in {', '.join(names[:NAMED])}{more}")
        return "; ".join(parts)
