"""Step: the choice. Decides the pick once the exploring steps are done: the fastest whole global step, within
noise of it the one with more headroom (`lines.best_so_far`), or, when nothing fitted, `NoFeasiblePlan` saying
what was tried and what to change. Then, once the confirming steps (`recheck.py`, `runoff.py`) are done,
`close`: the account of the pick (`reason`) and what the search left untried, before the steps after the pick
add trials of their own."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..configuration import Rung
from ..errors import NoFeasiblePlan
from ..evidence import Trial
from ..sizes import format_bytes
from .ledger import Ledger
from .lines import NOISE, best_so_far

# The clause of the caller's advice that asks for more techniques; the techniques searched are known only here,
# so it is narrowed to those left out (or dropped when none was) rather than suggesting what is already on.
_TECHNIQUES_CLAUSE = re.compile(r"allow more techniques[^(]*\(techniques=\([^)]*\)\), ")
_SUGGESTED = ("bf16", "checkpointing", "offload")


def choose(s: Ledger) -> Ledger:
    """Step: the pick, the best measured; `NoFeasiblePlan` when no trial fitted."""
    s.pick = best_so_far(s)
    if s.pick is None:
        raise NoFeasiblePlan(nothing_fits(s, s.lined_up), tuple(s.trials))
    return s


def close(s: Ledger) -> Ledger:
    """Step: the search closed: the account of its pick (`Ledger.head`, which the steps after the pick wrap in
    what they find) and how many of the configurations it lined up it neither measured nor ruled out
    (`Ledger.untried`, said when max_tune_seconds cut the tune short)."""
    s.head = reason(s, s.picked())
    s.untried = untried(s)
    return s


def untried(s: Ledger) -> int:
    """How many of the configurations the search lined up have no trial yet and were not ruled out."""
    tried = {t.rung for t in s.trials} | s.skipped
    return sum(r not in tried for r in dict.fromkeys(s.lined_up))


def _searched(rung: Rung, technique: str) -> bool:
    if technique == "bf16":
        return rung.precision != "fp32"  # FP16 with loss scaling stands in for it where the GPU lacks BF16
    return (rung.checkpointing if technique == "checkpointing" else rung.offload) != "none"


def narrowed_advice(advice: str, rungs: Sequence[Rung]) -> str:
    """`advice` asking only for the techniques no rung of the search used: "allow offload (add 'offload' to
    techniques)", or nothing about techniques when the search used them all."""
    missing = [name for name in _SUGGESTED if not any(_searched(r, name) for r in rungs)]
    if not missing:
        return _TECHNIQUES_CLAUSE.sub("", advice)
    names = ", ".join(repr(name) for name in missing)
    return _TECHNIQUES_CLAUSE.sub(f"allow {' and '.join(missing)} (add {names} to fit's techniques), ", advice)


def reason(s: Ledger, best: Trial) -> str:
    """The account of the pick, its factors from the trials the pick was made on: a runoff's re-measurement
    in place of the configuration's first reading."""
    latest = {(t.rung, t.micro_batch_size): t for t in s.trials if t.fits}  # a later reading wins
    plain = [t for t in latest.values() if t.rung.checkpointing == "none" and t.rung.offload == "none"
             and not t.rung.compile]
    head = f"{best.rung.name} at micro-batch {best.micro_batch_size}"
    fitting = len(latest)
    others = [t for t in latest.values() if t.rung != best.rung]
    runner_up = max(others, key=lambda t: t.samples_per_second, default=None)
    second = ""
    if runner_up is not None:
        margin = best.samples_per_second / runner_up.samples_per_second
        second = "; " + _against(best, runner_up)
    if best.rung.checkpointing == "none" and best.rung.offload == "none" and not best.rung.compile:
        return f"{head}: the fastest of {fitting} configurations that fit{second}"
    if plain:
        top = max(plain, key=lambda t: t.samples_per_second)
        return (f"{head}: {best.samples_per_second / top.samples_per_second:.2f}x the fastest plan without "
                f"checkpointing, offload or compile (micro-batch {top.micro_batch_size}){second}")
    if runner_up is not None:  # say what happened to the others: they fitted, only slower (or tied)
        slower = (f"; {runner_up.rung.name} at micro-batch {runner_up.micro_batch_size} fitted but "
                  f"{margin:.2f}x slower" if margin >= 1 + NOISE else second)
        return (f"{head}: none without checkpointing, offload or compile fits under the limit "
                f"({format_bytes(s.limit)}){slower}")
    return f"{head}: nothing lighter fits under the limit ({format_bytes(s.limit)})"


def _against(best: Trial, runner_up: Trial) -> str:
    """How the pick compares with the runner-up, in words: a lead within the timing noise is called a tie,
    and a slower pick is the tie-break `best_so_far` makes for headroom."""
    margin = best.samples_per_second / runner_up.samples_per_second
    other = f"{runner_up.rung.name} at micro-batch {runner_up.micro_batch_size}"
    if margin < 1:
        return (f"{other} measured {1 / margin:.2f}x as fast, within the {NOISE:.0%} timing noise, so the "
                f"pick is the one with the lower peak ({format_bytes(best.peak_bytes)} against "
                f"{format_bytes(runner_up.peak_bytes)}), for headroom")
    tie = f", within the {NOISE:.0%} timing noise" if margin < 1 + NOISE else ""
    return f"{margin:.2f}x the runner-up, {other}{tie}"


def nothing_fits(s: Ledger, rungs: Sequence[Rung]) -> str:
    ran = [t for t in s.trials if t.peak_bytes]
    smallest = min(ran, key=lambda t: t.peak_bytes) if ran else None
    tried = "; ".join(f"{t.rung.name} @ {t.micro_batch_size}: {t.outcome}" for t in s.trials)
    seen = (f"the smallest peak seen was {format_bytes(smallest.peak_bytes)} ({smallest.rung.name} at "
            f"micro-batch {smallest.micro_batch_size})" if smallest
            else "no trial got far enough to measure a peak")
    skipped = "".join(f" {n}." for n in s.notes)  # why rungs were left out, or the trial budget ran out
    return (f"no configuration fits under {format_bytes(s.limit)} (the budget less the margin) even at "
            f"micro-batch 1 on the top rung ({rungs[-1].name if rungs else 'none'}); {seen}. "
            f"Tried: {tried}.{skipped} {narrowed_advice(s.advice, rungs)}")
