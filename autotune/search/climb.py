"""The climb: each rung explored in order (two points, a prediction, a verification; bisection or growth
only after a miss), skipped where the time model says it cannot beat the best measured so far."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence

from ..configuration import Rung
from ..errors import InvalidSetting, TooFewSamples
from ..evidence import Trial
from ..sizes import format_bytes
from ..workload.batching import (
    bisect_next,
    ceil_div,
    fit_line,
    global_step_seconds,
    predict_max_micro_batch,
    smallest_micro_batch,
)
from .lines import MAX_BISECT, NOISE, Lines, RungState, Runner, balanced
from .noise import doubtful, settle

log = logging.getLogger("autotune.search.controller")


class Climb(Lines):
    """Exploring rungs one at a time (a part of `Controller`)."""

    runner: Runner
    retry: Runner | None
    max_trials: int
    notes: list[str]
    _settled: set[tuple[Rung, int]]  # (rung, micro-batch) already measured again: each is, once
    skipped: set[Rung]  # rungs the time model ruled out unmeasured
    smallest: int
    floor: int
    floor_note: str

    def _climb(self, rungs: Sequence[Rung]) -> None:
        """Explore each rung in order, unless the time model says it cannot beat the best measured."""
        previous = next((s for s in reversed(self.states) if s.ok), None)
        for rung in rungs:
            best = self._best()
            if best is not None:
                bound = self._upper_bound(rung, self.states)
                if bound is not None and bound <= best.samples_per_second * (1 + NOISE):
                    self.notes.append(f"skipped {rung.name}: at best {bound:,.1f} samples/s, "
                                      f"not above the {best.samples_per_second:,.1f} already measured")
                    self.skipped.add(rung)
                    continue
            if len(self.trials) >= self.max_trials:
                self.notes.append(f"stopped before {rung.name}: trial budget ({self.max_trials}) spent")
                return
            state = self._state(rung)
            self._explore(state, previous)
            if state.ok or previous is None:
                previous = state

    def _explore(self, state: RungState, previous: RungState | None) -> None:
        """Two points, a prediction, a verification; bisection only after a miss.

        A higher rung saves memory, so it starts at the largest micro-batch the rung below fitted and
        probes next the smallest that did not fit there: the one question this rung has to answer. A rung
        whose per-sample memory is already known (see `_borrowed_slope`) skips the probe and predicts.
        """
        start = previous.largest_ok or 1 if previous is not None else 1
        reach = self._predicted_reach(state.rung)
        if reach is not None:  # memory arithmetic from the measured siblings beats a guess from the last rung
            start = max(1, self._snap(balanced(min(reach, self.cap), self.per_rank)))
        first = self._run(state, min(start, self.cap))
        if not first.fits and first.micro_batch_size > self.floor:
            first = self._run(state, self.floor)
        if not first.fits or first.micro_batch_size >= self.cap:
            return
        slope = self._borrowed_slope(state)
        if slope is not None:
            reach = first.micro_batch_size + math.floor((self.limit - first.peak_bytes) / slope)
            guess = self._snap(min(self.cap, balanced(reach, self.per_rank)))
            if guess > first.micro_batch_size:
                self._verify(state, guess)
            return
        probe = previous.smallest_bad if previous is not None else None
        if probe is None or probe <= first.micro_batch_size:
            probe = 2 * first.micro_batch_size
        probe = self._snap(min(self.cap, probe))
        if probe <= first.micro_batch_size:  # no allowed size up to the probe (see `sizes`): the next one above
            probe = next(s for s in self.sizes or () if s > first.micro_batch_size)
        second = self._run(state, probe)
        if not second.fits:
            self._bisect(state)
            return
        if second.micro_batch_size >= self.cap:
            return
        points = [(t.micro_batch_size, t.peak_bytes) for t in state.trials if t.outcome != "oom"]
        guess = balanced(predict_max_micro_batch(points, self.limit, self.cap), self.per_rank)
        if guess > second.micro_batch_size and self._budget_left():
            self._verify(state, guess)

    def _verify(self, state: RungState, guess: int) -> None:
        """Run the predicted micro-batch; then narrow down if it did not fit, or grow if it left room."""
        if self._run(state, guess).fits:
            self._grow(state)
        else:
            self._bisect(state)

    def _borrowed_slope(self, state: RungState) -> float | None:
        """Bytes per sample of another measured rung that treats activations the same way, or None.

        Optimizer offload moves weights and optimizer state, a fixed cost; what each sample adds is set by
        precision, recompute and compile alone, so a rung with the same of those has measured it already
        (over a wider range than a second point here would: on GPT-2 large, 2 to 8 samples).
        """
        if state.rung.offload != "optimizer":
            return None
        return self._slope(state.rung)

    def _grow(self, state: RungState) -> None:
        """The prediction fitted: a miss on the low side if the line now says more fits.

        Peaks at small micro-batches are mostly fixed costs (cuDNN workspaces, allocator rounding), so the
        first two points can make the slope far too steep (on a ResNet, micro-batch 1 and 2 can predict a
        third of what fits). Re-predict from the two largest points, the local slope near the edge, while that
        saves accumulation steps.

        Where memory does not grow with the micro-batch (the line is flat: fixed costs swamp the activations),
        the line predicts nothing and each step doubles the micro-batch; such steps are growth, not refinement,
        and go on while the time line says they pay (`_worth_trying`), up to the per-rank batch.
        """
        refined = 0
        while refined < MAX_BISECT:
            lo = state.largest_ok
            if lo is None or lo >= self.cap or not self._budget_left():
                return
            points = sorted((t.micro_batch_size, t.peak_bytes) for t in state.trials if t.outcome != "oom")[-2:]
            guess = self._snap(balanced(predict_max_micro_batch(points, self.limit, self.cap), self.per_rank))
            if guess <= lo or ceil_div(self.per_rank, guess) == ceil_div(self.per_rank, lo):
                return  # no larger micro-batch saves an accumulation step
            if not self._worth_trying(state, guess):
                return
            if not self._run(state, guess).fits:
                self._bisect(state)
                return
            refined += fit_line(points)[1] > 0  # a doubling on a flat line is not a refinement

    def _bisect(self, state: RungState) -> None:
        """Narrow the gap between the largest micro-batch that fits and the smallest that does not.

        When the failure ran to the end (over the limit, not an OOM) its peak and the largest fitting
        one bracket the edge: the line between them says where the limit falls, and when it falls below
        the next size up nothing in between is tried (no trial is spent to learn that a size between ran
        over). After an OOM only the midpoint is known to be safe.
        """
        for _ in range(MAX_BISECT):
            lo, hi = state.largest_ok, state.smallest_bad
            if lo is None or hi is None or not self._budget_left():
                return
            mid = bisect_next(lo, hi)
            if mid is None:
                return
            edge = self._edge_between(state, lo, hi)
            if edge is not None:
                if edge <= lo:
                    return
                mid = min(hi - 1, edge)
            mid = self._snap(max(lo + 1, balanced(mid, self.per_rank)))
            if mid <= lo or mid >= hi or ceil_div(self.per_rank, mid) == ceil_div(self.per_rank, lo):
                return  # no micro-batch between them saves an accumulation step
            if not self._worth_trying(state, mid):
                return
            self._run(state, mid)

    def _edge_between(self, state: RungState, lo: int, hi: int) -> int | None:
        """The largest micro-batch under the limit on the line through the peaks at `lo` (fitted) and `hi`
        (ran over the limit); None when `hi` ran out of memory, so its peak is unknown."""
        below = next(t for t in state.trials if t.micro_batch_size == lo)
        above = next(t for t in state.trials if t.micro_batch_size == hi)
        if above.outcome != "over_budget" or above.peak_bytes <= below.peak_bytes:
            return None
        return predict_max_micro_batch([(lo, below.peak_bytes), (hi, above.peak_bytes)], self.limit, self.cap)

    def _worth_trying(self, state: RungState, micro: int) -> bool:
        """Whether a trial at `micro` could beat the best measured so far by more than noise.

        The rung's own time model (micro-step time ~ a + b x m, b >= 0, every micro-step charged as a full
        one, as trials are scored) is anchored at the rung's largest fitting trial. A larger micro-batch only
        raises the peak, and a plan within noise of the best is as good as the best: a trial predicted to gain
        less than that cannot improve the plan. One timed size gives no model: then it is worth a try.
        Asked only between or just past measured sizes (bisection, growth): a line through two nearby
        points extrapolated far is not a bound (such a line can rule out a configuration that wins at a
        micro-batch well inside the range).
        """
        best = self._best()
        anchor = max(state.ok, key=lambda t: t.micro_batch_size, default=None)
        timed = [(t.micro_batch_size, t.step_seconds) for t in state.trials if t.step_seconds > 0]
        if best is None or anchor is None or len({m for m, _ in timed}) < 2:
            return True
        a, b = fit_line(timed)
        b = max(b, 0.0)
        opt = min(t.optimizer_seconds for t in state.ok)

        def seconds(m: int) -> float:  # one global step at micro-batch m, by the model
            return global_step_seconds(max(a + b * m, 1e-9), opt, self.per_rank, m)

        predicted = anchor.samples_per_second * seconds(anchor.micro_batch_size) / seconds(micro)
        if predicted > best.samples_per_second * (1 + NOISE):
            return True
        self.notes.append(f"{state.rung.name}: skipped micro-batch {micro}, predicted {predicted:,.1f} samples/s, "
                          f"within noise of the {best.samples_per_second:,.1f} measured")
        return False

    def _run(self, state: RungState, micro: int) -> Trial:
        micro = max(self._snap(micro), self.floor)
        for t in state.trials:
            if t.micro_batch_size == micro:
                return t
        try:
            trial = self.runner(state.rung, micro)
        except TooFewSamples as exc:
            self._raise_floor(str(exc))
            return self._run(state, micro)
        log.debug("trial %-32s micro-batch %4d: %-11s peak %10s  %s", state.rung.name, micro, trial.outcome,
                 format_bytes(trial.peak_bytes),
                 f"{trial.samples_per_second:,.1f} samples/s" if trial.fits else trial.note)
        state.trials.append(trial)
        self.trials.append(trial)
        self._settle(state)
        return next(t for t in state.trials if t.micro_batch_size == micro)

    def _settle(self, state: RungState) -> None:
        """Measure again each of the rung's trials whose timing is in doubt (`noise.doubtful`: noisy, or slower
        than its siblings allow), once each, before it can end growth or decide the pick; the reading kept
        (`noise.settle`) takes the first one's place. Without `retry` (on a GPU) readings stand as measured."""
        if self.retry is None:
            return
        retry = self.retry
        for first in list(state.trials):
            siblings = [t for t in state.ok if t is not first]
            key = (first.rung, first.micro_batch_size)
            if key in self._settled or not doubtful(first, siblings):
                continue
            self._settled.add(key)
            kept = settle(first, functools.partial(retry, first.rung, first.micro_batch_size), siblings)
            log.debug("re-measured %-26s micro-batch %4d: %s", first.rung.name, first.micro_batch_size, kept.note)
            state.trials[state.trials.index(first)] = kept
            self.trials[self.trials.index(first)] = kept

    def _raise_floor(self, failure: str) -> None:
        """Micro-batch 1 failed on batch statistics (BatchNorm over one value per channel): no micro-batch
        of the plan may hold fewer than 2 samples, so the search starts at the smallest size whose split
        of the per-rank batch keeps every micro-batch at 2 or more (3 for an odd batch)."""
        floor = smallest_micro_batch(self.per_rank, 2)
        if floor is None:
            raise InvalidSetting(f"the model cannot train on a micro-batch of 1 sample ({failure}: batch statistics "
                                 f"such as BatchNorm need at least 2), and the per-rank batch is {self.per_rank}; "
                                 "raise global_batch_size to 2 or more samples per rank") from None
        self.smallest, self.floor = 2, floor
        self.floor_note = (f"micro-batch 1 skipped: {failure} (batch statistics), so every micro-batch holds "
                           f"2 samples or more and the split is balanced; the search starts at {self.floor}")
        self.notes.insert(0, self.floor_note)

    def _budget_left(self) -> bool:
        return len(self.trials) < self.max_trials
