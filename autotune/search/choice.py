"""The choice: the fastest whole global step (within noise, the one with more headroom), re-measured where a
single reading should not decide, and the reason for it, or why nothing fits."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence

from ..configuration import Rung
from ..evidence import Trial
from ..sizes import format_bytes
from .lines import NOISE, RUNOFF, Lines, Runner

log = logging.getLogger("autotune.search.controller")

# The clause of the caller's advice that asks for more techniques; the techniques searched are known only here,
# so it is narrowed to those left out (or dropped when none was) rather than suggesting what is already on.
_TECHNIQUES_CLAUSE = re.compile(r"allow more techniques[^(]*\(techniques=\([^)]*\)\), ")
_SUGGESTED = ("bf16", "checkpointing", "offload")


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


class Choice(Lines):
    """Choosing among the measured trials (a part of `Controller`)."""

    remeasure: Runner | None
    notes: list[str]
    advice: str

    def _runoff(self, best: Trial) -> Trial:
        """Re-measure the leaders with longer runs when they are close: near the memory edge single
        trials are erratic (allocator retries, launch jitter), and the pick must not hinge on one."""
        if self.remeasure is None:
            return best
        ok = [t for t in self.trials if t.fits]
        rivals = sorted((t for t in ok if t.rung != best.rung and t.samples_per_second >= best.samples_per_second
                         * (1 - RUNOFF)), key=lambda t: -t.samples_per_second)
        if not rivals:
            return best
        finalists = [self.remeasure(t.rung, t.micro_batch_size) for t in (best, rivals[0])]
        for t in finalists:
            log.debug("runoff %-31s micro-batch %4d: %-11s %s samples/s", t.rung.name, t.micro_batch_size,
                     t.outcome, f"{t.samples_per_second:,.1f}")
        self.trials.extend(finalists)
        fitting = [t for t in finalists if t.fits]
        if not fitting:
            return best
        fastest = max(t.samples_per_second for t in fitting)
        close = [t for t in fitting if t.samples_per_second >= fastest * (1 - NOISE)]
        winner = min(close, key=lambda t: (t.peak_bytes, -t.samples_per_second))
        self.notes.append(f"runoff between {finalists[0].rung.name} @ {finalists[0].micro_batch_size} and "
                          f"{finalists[1].rung.name} @ {finalists[1].micro_batch_size}")
        return winner

    def _recheck_recompute(self, best: Trial) -> Trial:
        """Re-measure a win that the work a configuration adds cannot explain, rather than believe it.

        Recomputing blocks and offloading only add work: at the same or a smaller micro-batch, with the same
        compile, a configuration that recomputes as many blocks or more and offloads the same (or, beside one
        that offloads nothing, anything) cannot beat the other by more than noise. When it seems to (a
        neighbour took the CPU during the plain trial: "4.46x faster with checkpointing" on ResNet-18 at a
        roomy budget; "offload <0.01% of the parameters, 4.90x faster" on a tiny model), both are measured
        again, longer; the re-measurements take the first ones' places in the record (their notes keep the
        first figures), and the pick is made again.
        """
        if self.remeasure is None or (best.rung.checkpointing, best.rung.offload) == ("none", "none"):
            return best
        ok = [t for t in self.trials if t.fits]
        # (more work, less work) pairs where the one with more work ran at a micro-batch no larger and still won
        pairs = [(c, p) for c in ok for p in ok if _adds_work(c.rung, p.rung)
                 and c.micro_batch_size <= p.micro_batch_size
                 and c.samples_per_second > p.samples_per_second * (1 + NOISE)]
        if not pairs:
            return best
        ckpt, plain = max(pairs, key=lambda cp: cp[0].samples_per_second / cp[1].samples_per_second)
        now = []
        for first in (ckpt, plain):
            again = self.remeasure(first.rung, first.micro_batch_size)
            note = f"re-measured; first {first.samples_per_second:,.1f} samples/s"
            now.append(dataclasses.replace(again, note=f"{again.note}; {note}" if again.note else note))
            self.trials[self.trials.index(first)] = now[-1]
        # Said with the figures the pick is then made on: the first ones are in the re-measured trials' notes.
        factor = now[0].samples_per_second / now[1].samples_per_second if now[1].samples_per_second else 0.0
        what = "recompute" if ckpt.rung.offload == plain.rung.offload else "offloading"
        self.notes.append(
            f"{ckpt.rung.name} at micro-batch {ckpt.micro_batch_size} beat {plain.rung.name} at micro-batch "
            f"{plain.micro_batch_size} by more than {what} can explain: both re-measured, now {factor:.2f}x")
        return self._best() or best

    def _reason(self, best: Trial) -> str:
        """The account of the pick, its factors from the trials the pick was made on: a runoff's re-measurement
        in place of the configuration's first reading."""
        latest = {(t.rung, t.micro_batch_size): t for t in self.trials if t.fits}  # a later reading wins
        plain = [t for t in latest.values() if t.rung.checkpointing == "none" and t.rung.offload == "none"
                 and not t.rung.compile]
        head = f"{best.rung.name} at micro-batch {best.micro_batch_size}"
        fitting = len(latest)
        others = [t for t in latest.values() if t.rung != best.rung]
        runner_up = max(others, key=lambda t: t.samples_per_second, default=None)
        second = ""
        if runner_up is not None:
            margin = best.samples_per_second / runner_up.samples_per_second
            second = "; " + self._against(best, runner_up)
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
                    f"({format_bytes(self.limit)}){slower}")
        return f"{head}: nothing lighter fits under the limit ({format_bytes(self.limit)})"

    @staticmethod
    def _against(best: Trial, runner_up: Trial) -> str:
        """How the pick compares with the runner-up, in words: a lead within the timing noise is called a tie,
        and a slower pick is the tie-break `_best` makes for headroom."""
        margin = best.samples_per_second / runner_up.samples_per_second
        other = f"{runner_up.rung.name} at micro-batch {runner_up.micro_batch_size}"
        if margin < 1:
            return (f"{other} measured {1 / margin:.2f}x as fast, within the {NOISE:.0%} timing noise, so the "
                    f"pick is the one with the lower peak ({format_bytes(best.peak_bytes)} against "
                    f"{format_bytes(runner_up.peak_bytes)}), for headroom")
        tie = f", within the {NOISE:.0%} timing noise" if margin < 1 + NOISE else ""
        return f"{margin:.2f}x the runner-up, {other}{tie}"

    def _nothing_fits(self, rungs: Sequence[Rung]) -> str:
        ran = [t for t in self.trials if t.peak_bytes]
        smallest = min(ran, key=lambda t: t.peak_bytes) if ran else None
        tried = "; ".join(f"{t.rung.name} @ {t.micro_batch_size}: {t.outcome}" for t in self.trials)
        seen = (f"the smallest peak seen was {format_bytes(smallest.peak_bytes)} ({smallest.rung.name} at "
                f"micro-batch {smallest.micro_batch_size})" if smallest
                else "no trial got far enough to measure a peak")
        skipped = "".join(f" {n}." for n in self.notes)  # why rungs were left out, or the trial budget ran out
        return (f"no configuration fits under {format_bytes(self.limit)} (the budget less the margin) even at "
                f"micro-batch 1 on the top rung ({rungs[-1].name if rungs else 'none'}); {seen}. "
                f"Tried: {tried}.{skipped} {narrowed_advice(self.advice, rungs)}")


_DEPTH = {"none": 0, "selective": 1, "full": 2}  # a label's order, for rungs that carry no block count


def _depth(rung: Rung) -> tuple[int, int]:
    return _DEPTH[rung.checkpointing], rung.checkpointed_blocks or 0


def _adds_work(more: Rung, less: Rung) -> bool:
    """Whether `more` does all the work `less` does and more: the same precision and compile, as many recomputed
    blocks or more, and the same offload or offload where `less` has none."""
    return (more != less and (more.precision, more.compile) == (less.precision, less.compile)
            and _depth(more) >= _depth(less)
            and (more.offload == less.offload or less.offload == "none"))
