"""The decision graph: which trial to run next, and which measured configuration wins.

Per rung: measure two micro-batch sizes, predict from the memory slope the largest that keeps the peak
under the limit, verify it with one trial, and refine only when the prediction missed: bisect after it
went over, re-predict from the local slope when it fitted with room to spare; no refining trial runs
that the rung's time model says cannot beat the best measured so far by more than noise. Across rungs:
climb while a higher rung can still beat the best measured so far, judged from the time model of the
best rung (time per micro-step ~ a + b x m): a higher rung lets the micro-batch grow, but costs at
least its recompute/copy overhead per sample, so it cannot beat `per_rank / (a + (1 + overhead) x b x
per_rank + optimizer)`. The winner is the fastest whole global step; within noise, the one with more
headroom. The controller takes the trial runner as an argument, so tests drive it with scripted fakes.

`sizes` restricts the micro-batches tried (zero-change trials of `autotune run` need divisors of the
per-rank batch, since the script does its own batching): every size asked for is snapped down to an
allowed one, and growth moves to the next allowed size when snapping would stand still.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
import dataclasses
from dataclasses import dataclass, field

from ..workload.batching import (bisect_next, ceil_div, fit_line, global_step_seconds, predict_max_micro_batch,
                                 smallest_micro_batch)
from ..errors import InvalidSetting, NoFeasiblePlan, TooFewSamples
from ..configuration import Rung
from ..evidence import Trial
from ..sizes import format_bytes

log = logging.getLogger(__name__)

Runner = Callable[[Rung, int], Trial]

# Least extra time per sample a rung adds over plain BF16 (optimistic on purpose: a rung is skipped only
# when even this cannot win). Full recompute is about one more forward (~+33% of a step); PEERS.md
# lesson 6 measured 10-21% tokens/s lost.
MIN_OVERHEAD = {"none": 0.0, "selective": 0.05, "full": 0.10, "activations": 0.15, "optimizer": 0.10}
MAX_PLACED = 2  # trials per offload spent placing an intermediate block count, or compile, after a miss
NOISE = 0.03  # step-time medians closer than this are a tie
RUNOFF = 0.08  # rungs whose best is this close to the leader get re-measured with a longer run
MAX_BISECT = 2  # bisection (or growth) steps per rung after a missed prediction


@dataclass(frozen=True, kw_only=True)
class Lattice:
    """What the search may place beyond the anchor configurations it is given.

    `blocks` is N, the repeated blocks checkpointing can recompute (0: no such knob); `compile` says
    whether compiled configurations may be tried; `floors` is each anchor's resident floor by memory
    arithmetic (weights, gradients, optimizer state on the device), which predicts a rung's measured
    floor from a sibling's: the arithmetic difference is exact for what moves to the host.
    """

    blocks: int = 0
    compile: bool = False
    floors: dict[Rung, int] = field(default_factory=dict)
    shares: tuple[float, ...] | None = None  # share of the recompute's saving the first k blocks give, k=0..N
    # (blocks are recomputed largest first, so more than k/N); None: k/N


@dataclass(kw_only=True)
class SearchResult:
    best: Trial
    trials: list[Trial]
    reason: str
    notes: list[str] = field(default_factory=list)
    smallest: int = 1  # the fewest samples a micro-batch may hold (2 when batch statistics need them)
    floor_note: str = ""  # why micro-batch 1 was skipped (also first in `notes`), or ""


@dataclass(kw_only=True)
class _RungState:
    rung: Rung
    trials: list[Trial] = field(default_factory=list)

    @property
    def ok(self) -> list[Trial]:
        return [t for t in self.trials if t.fits]

    @property
    def smallest_bad(self) -> int | None:
        bad = [t.micro_batch_size for t in self.trials if not t.fits]
        return min(bad) if bad else None

    @property
    def largest_ok(self) -> int | None:
        ok = [t.micro_batch_size for t in self.ok]
        return max(ok) if ok else None


# What to change when nothing fits, in `fit`'s words; `autotune run` gives its own options' (`advice`).
FIT_ADVICE = ("Raise memory_budget, allow more techniques (techniques=('bf16', 'checkpointing', 'offload')), "
              "or shrink the model or the sequence.")


class Controller:
    def __init__(self, runner: Runner, *, per_rank: int, limit_bytes: int, max_micro: int | None = None,
                 max_trials: int = 24, world_size: int = 1, sizes: Sequence[int] | None = None,
                 remeasure: Runner | None = None, advice: str = FIT_ADVICE) -> None:
        self.runner = runner
        self.advice = advice  # the last sentence of the error when nothing fits
        self.remeasure = remeasure  # a longer-running runner for the final runoff; None skips it
        self.per_rank = per_rank
        self.limit = limit_bytes
        self.sizes = sorted({s for s in sizes if 1 <= s <= per_rank} | {1}) if sizes else None
        self.cap = self._snap(max(1, min(per_rank, max_micro or per_rank)))
        self.max_trials = max_trials
        self.world_size = world_size
        self.trials: list[Trial] = []
        self.states: list[_RungState] = []
        self.notes: list[str] = []
        self.lattice = Lattice()
        self._compiled: _Compiled | None = None  # what compile saved beside eager, once measured
        self._compiled_recompute: _Compiled | None = None  # the same with blocks recomputed, once measured
        self._compile_failed = False
        self.smallest = 1  # fewest samples a micro-batch may hold: 2 once batch statistics refused 1
        self.floor = 1  # the smallest micro-batch tried: no split of per_rank at it holds fewer than `smallest`
        self.floor_note = ""  # why micro-batch 1 was skipped, once it was

    # -- top level -------------------------------------------------------------------------------------
    def search(self, rungs: Sequence[Rung], lattice: Lattice | None = None) -> SearchResult:
        """Measure the anchor `rungs` in order; then, given a `lattice`, place an intermediate block count
        per offload and try compile where the measurements say they can win; pick the fastest."""
        self.lattice = lattice or Lattice()
        if lattice is None:
            self._climb(rungs)
        else:
            # No recompute first, then compile beside it: compile's gain bounds what the recompute rungs
            # can still win, so they are skipped rather than measured when they cannot.
            self._climb([r for r in rungs if r.checkpointed_blocks == 0])
            self._place_compile()
            self._climb([r for r in rungs if r.checkpointed_blocks != 0])
            self._place_blocks()
            self._place_compile()
            self._place_compiled_recompute()
        best = self._best()
        if best is None:
            raise NoFeasiblePlan(self._nothing_fits(rungs), tuple(self.trials))
        best = self._recheck_recompute(best)
        best = self._runoff(best)
        return SearchResult(best=best, trials=list(self.trials), reason=self._reason(best), notes=self.notes,
                            smallest=self.smallest, floor_note=self.floor_note)

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
                    continue
            if len(self.trials) >= self.max_trials:
                self.notes.append(f"stopped before {rung.name}: trial budget ({self.max_trials}) spent")
                return
            state = self._state(rung)
            self._explore(state, previous)
            if state.ok or previous is None:
                previous = state

    # -- one rung --------------------------------------------------------------------------------------
    def _explore(self, state: _RungState, previous: _RungState | None) -> None:
        """Two points, a prediction, a verification; bisection only after a miss.

        A higher rung saves memory, so it starts at the largest micro-batch the rung below fitted and
        probes next the smallest that did not fit there: the one question this rung has to answer. A rung
        whose per-sample memory is already known (see `_borrowed_slope`) skips the probe and predicts.
        """
        start = previous.largest_ok or 1 if previous is not None else 1
        reach = self._predicted_reach(state.rung)
        if reach is not None:  # memory arithmetic from the measured siblings beats a guess from the last rung
            start = max(1, self._snap(_balanced(min(reach, self.cap), self.per_rank)))
        first = self._run(state, min(start, self.cap))
        if not first.fits and first.micro_batch_size > self.floor:
            first = self._run(state, self.floor)
        if not first.fits or first.micro_batch_size >= self.cap:
            return
        slope = self._borrowed_slope(state)
        if slope is not None:
            reach = first.micro_batch_size + math.floor((self.limit - first.peak_bytes) / slope)
            guess = self._snap(min(self.cap, _balanced(reach, self.per_rank)))
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
        guess = _balanced(predict_max_micro_batch(points, self.limit, self.cap), self.per_rank)
        if guess > second.micro_batch_size and self._budget_left():
            self._verify(state, guess)

    def _verify(self, state: _RungState, guess: int) -> None:
        """Run the predicted micro-batch; then narrow down if it did not fit, or grow if it left room."""
        if self._run(state, guess).fits:
            self._grow(state)
        else:
            self._bisect(state)

    def _borrowed_slope(self, state: _RungState) -> float | None:
        """Bytes per sample of another measured rung that treats activations the same way, or None.

        Optimizer offload moves weights and optimizer state, a fixed cost; what each sample adds is set by
        precision, recompute and compile alone, so a rung with the same of those has measured it already
        (over a wider range than a second point here would: on GPT-2 large, 2 to 8 samples).
        """
        if state.rung.offload != "optimizer":
            return None
        return self._slope(state.rung)

    def _slope(self, rung: Rung) -> float | None:
        """Measured bytes per sample for `rung`'s treatment of activations (two sizes or more), or None."""
        # The rung's own offload first: on GPT-2 large (H100) plain bf16 measured 4.2 GiB per sample from
        # micro-batch 1 and 2, optimizer offload 5.0 from 3 and 4; the compile saving is judged against the latter.
        for other in sorted(self.states, key=lambda s: s.rung.offload != rung.offload):
            points = [(t.micro_batch_size, t.peak_bytes) for t in other.trials if t.outcome in ("ok", "over_budget")]
            if _activations(other.rung) == _activations(rung) and len({m for m, _ in points}) >= 2:
                _, slope = fit_line(points)
                return slope if slope > 0 else None
        return None

    def _floor(self, rung: Rung) -> float | None:
        """`rung`'s resident floor: measured on a rung with the same floor (the intercept under a known
        slope), else a measured sibling's shifted by the arithmetic difference of the two floors."""
        floors = self.lattice.floors
        # A measured floor of the same offload beats one shifted by arithmetic from a sibling's.
        for other in sorted(self.states, key=lambda s: (s.rung.optimizer_8bit != rung.optimizer_8bit,
                                                         s.rung.offload != rung.offload)):
            slope = self._slope(other.rung)
            ran = [t for t in other.trials if t.outcome in ("ok", "over_budget")]
            if slope is None or not ran:
                continue
            top = max(ran, key=lambda t: t.micro_batch_size)
            measured = top.peak_bytes - slope * top.micro_batch_size
            same_state = other.rung.optimizer_8bit == rung.optimizer_8bit  # 8-bit state: a smaller floor
            if same_state and (other.rung.offload == rung.offload
                               or (other.rung.offload != "optimizer") == (rung.offload != "optimizer")):
                return measured
            if rung in floors and other.rung in floors:
                return measured + floors[rung] - floors[other.rung]
        return None

    def _predicted_reach(self, rung: Rung) -> int | None:
        """The largest micro-batch `rung` should fit by the measured memory line, or None if unknown."""
        slope, floor = self._slope(rung), self._floor(rung)
        if slope is None or floor is None:
            return None
        return max(0, math.floor((self.limit - floor) / slope))

    # -- the lattice beyond the anchors --------------------------------------------------------------
    def _place_blocks(self) -> None:
        """Per offload, the fewest recomputed blocks that let a faster micro-batch fit, predicted from the
        bytes per sample measured with none and with all blocks recomputed, then verified."""
        n = self.lattice.blocks
        if n < 2:
            return
        for offload in ("none", "optimizer"):
            if not any(s.rung.offload == offload and not s.rung.compile for s in self.states):
                continue
            candidates = [c for c in self._candidates(offload, compiled=None) if 0 < c[0].checkpointed_blocks < n]
            self._try_best(candidates, f"{offload} offload, blocks recomputed")

    def _place_compile(self) -> None:
        """Compile where it can win, measured once per search: first at the largest micro-batch that fitted
        eager with no recompute (compile only lowers memory, so it fits there), which measures what compile
        saves in time and bytes; then at the largest micro-batch that saving predicts to fit, and from the
        two points on, along the compiled configuration's own memory line (grow or bisect, as any rung).

        Compiled configurations placed here recompute no block, and keep the probe's offload unless compile's
        measured savings predict a win with the other one (`_compile_other_offload`); compile with blocks
        recomputed comes after the recompute rungs are measured (`_place_compiled_recompute`). One point does
        not tell compile's floor from its bytes per sample (on GPT-2 large its workspaces raised the floor
        by 1.6 GiB while each sample took 0.38x the bytes), hence the second point before any growth.
        """
        if not self.lattice.compile or self._compile_failed or self._compiled is not None or not self._budget_left():
            return
        probe = self._compile_probe()
        if probe is None:
            return
        eager, rung, micro = probe
        state = self._state(rung)
        first = self._run(state, micro)
        if first.outcome == "error":
            self._compile_failed = True
            self.notes.append(f"compile failed ({first.note}); the plan stays eager")
            return
        if not first.fits or first.step_seconds <= 0:
            return
        floor = self._floor(eager.rung) or 0.0
        ratio = (first.peak_bytes - floor) / max(1.0, eager.peak_bytes - floor)
        self._compiled = _Compiled(memory=min(1.0, max(0.05, ratio)), time=first.step_seconds / eager.step_seconds)
        sizes = [m for r, m, _ in self._candidates(rung.offload, compiled=self._compiled) if r.checkpointed_blocks == 0]
        # No prediction at all where the eager line is unknown (GPT-2 XL at 16 GiB, H100: eager fitted one
        # sample and ran out of memory at two, its peak unseen): one size up on compile's own terms, after
        # which its own two points decide, as for any rung (grow, or bisect after a miss).
        guess = max(sizes) if sizes else self._next_size(first.micro_batch_size)
        if guess > first.micro_batch_size and self._budget_left():
            self._verify(state, guess)
        self._compile_other_offload(rung.offload)

    def _place_compiled_recompute(self) -> None:
        """Compile with blocks recomputed: first the fastest eager recompute configuration compiled, at its
        micro-batch (compile only lowers memory, so it fits there), which measures what compile saves with
        recompute on; then, with that ratio, the compiled block count and micro-batch predicted fastest.

        A recomputed block runs its compiled forward inside the checkpoint (`techniques/compile.py`), so the
        recompute runs fused kernels too, and what compile saves depends on the micro-batch: on GPT-2 XL at
        16 GiB (H100) compile was 1.08x *slower* than eager at one sample (a launch-bound step: 64 micro-steps
        of guards and calls), while with every block recomputed at 8 samples it made the step 1.90x faster
        (24,945 against 13,127 tok/s), also beating compile without recompute at 2 x 32 (17,478): RESULTS.md,
        2026-11-27. So the ratio measured without recompute, at the small micro-batch compile fitted, does
        not predict this one; it is measured where it applies.
        """
        if self._compiled is None or self.lattice.blocks < 1 or not self._budget_left():
            return
        # Only where recompute lets a micro-batch grow past what compile without it reached: recompute itself
        # only adds work.
        reach = max((t.micro_batch_size for t in self.trials if t.fits and t.rung.compile
                     and not t.rung.checkpointed_blocks), default=0)
        eager = [t for t in self.trials if t.fits and t.rung.checkpointed_blocks and not t.rung.compile
                 and t.rung.offload in ("none", "optimizer") and t.step_seconds > 0 and t.micro_batch_size > reach]
        if not eager:
            return
        base = max(eager, key=lambda t: t.samples_per_second)
        state = self._state(dataclasses.replace(base.rung, compile=True))
        first = next((t for t in state.trials if t.micro_batch_size == base.micro_batch_size), None)
        first = first or self._run(state, base.micro_batch_size)
        if first.outcome == "error":
            self.notes.append(f"compile with blocks recomputed failed ({first.note}); not tried again")
            return
        if not first.fits and self._budget_left():
            # Compile's workspaces raise the floor (GPT-2 large: 1.6 GiB): once down by what the miss was
            # over, at eager recompute's bytes per sample; one size down after an OOM (no peak to go by).
            slope = self._slope(base.rung)
            over = first.peak_bytes - self.limit if first.outcome == "over_budget" and slope else 0
            smaller = [m for m in self._sizes() if m < first.micro_batch_size and not self._one_sample_left(m)
                       and (not over or m <= first.micro_batch_size - over / slope)]
            if smaller:
                first = self._run(state, max(smaller))
        line = self._step_line(base.rung)
        if not first.fits or first.step_seconds <= 0 or line is None:
            return
        eager_seconds = line[0] + line[1] * first.micro_batch_size  # eager recompute at the same size
        measured = _Compiled(memory=self._compiled.memory, time=first.step_seconds / max(eager_seconds, 1e-9))
        self._compiled_recompute = measured
        candidates = [c for offload in ("none", "optimizer") if any(s.rung.offload == offload for s in self.states)
                      for c in self._candidates(offload, compiled=measured) if c[0].checkpointed_blocks]
        self._try_best(candidates, "compile with blocks recomputed")

    def with_room(self, like: Rung, freed: float) -> list[tuple[Rung, int, float]]:
        """(rung, micro-batch, predicted samples/s), fastest first: what `like`'s offload and compile would fit
        with `freed` more bytes under the limit, by the measured lines, each at the fewest blocks recomputed
        for its micro-batch (search/partitioned_state.py asks, once the optimizer state it would partition
        over the ranks has been measured to free that much)."""
        compiled = (self._compiled_recompute or self._compiled) if like.compile else None
        if like.compile and compiled is None:
            return []
        limit, self.limit = self.limit, int(self.limit + freed)
        try:
            candidates = self._candidates(like.offload, compiled)
        finally:
            self.limit = limit
        return sorted(candidates, key=lambda c: -c[2])

    def _compile_other_offload(self, measured: str) -> None:
        """Compile with the other of no offload and optimizer offload, where what compile saved beside the
        probe (time and bytes per sample, as ratios) predicts it beats the best by more than noise.

        Which offload leads eager need not lead compiled: compile shrinks what each sample holds, so the
        micro-batch each offload reaches, and with it what optimizer offload's host step costs a sample,
        changes. On two H100s (GPT-2 medium, 16 GiB per rank, 32 samples a rank) eager optimizer offload led
        (73 against 44 samples/s) and compile went only there (85); compile without offload, the plan of
        the 1.885x run on two H200s, was never tried. Per-block compile makes the other offload's new
        graph (its parameters' dtype differs) seconds of compiling, not the 110 s of whole-model compile.
        """
        other = "none" if measured == "optimizer" else "optimizer" if measured == "none" else ""
        if self._compiled is None or not other or not self._budget_left():
            return
        candidates = [c for c in self._candidates(other, compiled=self._compiled) if c[0].checkpointed_blocks == 0]
        self._try_best(candidates, f"compile with {'optimizer offload' if other == 'optimizer' else 'no offload'}")

    def _next_size(self, micro: int) -> int:
        """The next micro-batch above `micro` that saves an accumulation step and leaves no one-sample last
        micro-batch (a size compile specializes); `micro` when there is none."""
        larger = [m for m in self._sizes() if m > micro and not self._one_sample_left(m)]
        return min(larger, default=micro)

    def _one_sample_left(self, micro: int) -> bool:
        """Whether splitting the per-rank batch at `micro` leaves a last micro-batch of one sample: a size
        compile specializes, so a second graph to compile."""
        return micro > 1 and self.per_rank % micro == 1

    def _compile_probe(self) -> tuple[Trial, Rung, int] | None:
        """The eager trial compile is first measured beside, the compiled rung, and the size to run it at:
        the fastest eager configuration without recompute, at its largest micro-batch that leaves no
        one-sample last micro-batch (a size compile specializes: a second graph to compile)."""
        ok = [t for t in self.trials if t.fits and not t.rung.compile and t.rung.offload != "activations"]
        bare = [t for t in ok if t.rung.checkpointing == "none"]
        if not bare:
            return None
        leader = max(bare, key=lambda t: t.samples_per_second).rung
        eager = max((t for t in bare if t.rung == leader), key=lambda t: t.micro_batch_size)
        micro = max(m for m in range(1, eager.micro_batch_size + 1) if not self._one_sample_left(m))
        return eager, dataclasses.replace(leader, compile=True), self._snap(micro)

    def _candidates(self, offload: str, compiled: _Compiled | None) -> list[tuple[Rung, int, float]]:
        """(rung, micro-batch, predicted samples/s) for each accumulation count: the fewest blocks
        recomputed that fit that micro-batch by the measured lines, for `offload`, eager or compiled.

        Compiled, the blocks not recomputed follow compile's own measured line where it has one (bytes and
        time per sample), else eager's scaled by what compile saved; the recomputed ones follow eager full
        recompute's, its time scaled by compile's ratio. (GPT-2 XL at 16 GiB: eager fits one sample, so only
        compile's line says what its blocks keep.)"""
        n = self.lattice.blocks
        precision = self.states[0].rung.precision
        lo = Rung(precision=precision, offload=offload, checkpointed_blocks=0)
        hi = dataclasses.replace(lo, checkpointing="full", checkpointed_blocks=n) if n else lo
        s0 = self._slope(lo) or self._slope(dataclasses.replace(lo, offload="none"))
        sn = (self._slope(hi) or self._slope(dataclasses.replace(hi, offload="none"))) if n else s0
        floor = self._floor(lo)
        opt = self._optimizer_seconds(offload)
        t0 = self._step_line(lo)
        tn = self._step_line(hi) if n else t0
        time0 = timen = compiled.time if compiled else 1.0
        memory = compiled.memory if compiled else 1.0
        if compiled is not None:
            lo_c = dataclasses.replace(lo, compile=True)
            own_slope, own_line = self._slope(lo_c), self._step_line(lo_c)
            if own_slope is not None and own_line is not None:
                s0, t0, memory, time0 = own_slope, own_line, 1.0, 1.0
        if None in (s0, floor, opt, t0):
            return []
        if sn is None or tn is None:  # recompute not measured yet: only configurations without it
            n, sn, tn = 0, s0, t0
        out = []
        for micro in self._sizes():
            if compiled is not None and self._one_sample_left(micro):
                continue  # a last micro-batch of one sample is a shape compile specializes: a recompile
            k = _blocks_needed(floor, s0, sn, n, micro, self.limit, memory, self.lattice.shares)
            if k is None:
                continue
            label = "none" if k == 0 else "full" if k == self.lattice.blocks else "selective"
            rung = dataclasses.replace(lo, checkpointing=label, checkpointed_blocks=k, compile=compiled is not None)
            frac = k / n if n else 0.0
            seconds = (1 - frac) * (t0[0] + t0[1] * micro) * time0 + frac * (tn[0] + tn[1] * micro) * timen
            rate = self.per_rank * self.world_size / global_step_seconds(max(seconds, 1e-9), opt, self.per_rank, micro)
            out.append((rung, micro, rate))
        return out

    def _try_best(self, candidates: list[tuple[Rung, int, float]], what: str) -> None:
        """Run the candidate predicted fastest, if it can beat the best by more than noise and was not
        measured; after a miss, the next one the miss does not rule out (one with fewer blocks recomputed
        at as many samples would run over too); after a fit, grow it along its own memory line."""
        measured = {(t.rung, t.micro_batch_size) for t in self.trials}
        pool = sorted((c for c in candidates if (c[0], c[1]) not in measured), key=lambda c: -c[2])
        for _ in range(MAX_PLACED):
            best = self._best()
            if not pool or best is None or not self._budget_left():
                return
            rung, micro, rate = pool.pop(0)
            if rate <= best.samples_per_second * (1 + NOISE):
                self.notes.append(f"{what}: no configuration predicted above the {best.samples_per_second:,.1f} "
                                  f"samples/s measured (best {rung.name} @ {micro}: {rate:,.1f})")
                return
            state = self._state(rung)
            trial = self._run(state, micro)
            if trial.fits:
                if len({t.micro_batch_size for t in state.ok}) >= 2:
                    self._grow(state)
                return
            if trial.outcome == "error":
                return
            if state.ok:  # a smaller size of this configuration fitted: the edge lies between the two
                self._bisect(state)
                return
            pool = [c for c in pool if not _ruled_out(c, rung, micro)]

    def _state(self, rung: Rung) -> _RungState:
        for state in self.states:
            if state.rung == rung:
                return state
        state = _RungState(rung=rung)
        self.states.append(state)
        return state

    def _sizes(self) -> list[int]:
        """One micro-batch per accumulation count (the smallest for it: same speed, most headroom)."""
        return sorted({self._snap(_balanced(m, self.per_rank)) for m in range(1, self.cap + 1)})

    def _step_line(self, rung: Rung) -> tuple[float, float] | None:
        """Micro-step seconds ~ a + b x m on the rung, or on one that treats activations alike; one timed
        size gives a line through the origin (every second proportional to the samples: optimistic)."""
        for state in sorted(self.states, key=lambda s: s.rung != rung):
            timed = _timed(state)
            if _activations(state.rung) != _activations(rung) or not timed:
                continue
            if len({m for m, _ in timed}) >= 2:
                a, b = fit_line(timed)
                return max(a, 0.0), max(b, 0.0)
            m, s = timed[0]
            return 0.0, s / m
        return None

    def _optimizer_seconds(self, offload: str) -> float | None:
        times = [t.optimizer_seconds for t in self.trials if t.fits and t.rung.offload == offload]
        return min(times) if times else None

    def _grow(self, state: _RungState) -> None:
        """The prediction fitted: a miss on the low side if the line now says more fits.

        Peaks at small micro-batches are mostly fixed costs (cuDNN workspaces, allocator rounding), so the
        first two points can make the slope far too steep: on ResNet-152 (H100) micro-batch 1 and 2 predicted
        43, which peaked at 6.1 of 10.8 GiB, while 64 fitted and ran 1.5x faster. Re-predict from the two
        largest points, the local slope near the edge, while that saves accumulation steps.
        """
        for _ in range(MAX_BISECT):
            lo = state.largest_ok
            if lo is None or lo >= self.cap or not self._budget_left():
                return
            points = sorted((t.micro_batch_size, t.peak_bytes) for t in state.trials if t.outcome != "oom")[-2:]
            guess = self._snap(_balanced(predict_max_micro_batch(points, self.limit, self.cap), self.per_rank))
            if guess <= lo or ceil_div(self.per_rank, guess) == ceil_div(self.per_rank, lo):
                return  # no larger micro-batch saves an accumulation step
            if not self._worth_trying(state, guess):
                return
            if not self._run(state, guess).fits:
                self._bisect(state)
                return

    def _bisect(self, state: _RungState) -> None:
        """Narrow the gap between the largest micro-batch that fits and the smallest that does not.

        When the failure ran to the end (over the limit, not an OOM) its peak and the largest fitting
        one bracket the edge: the line between them says where the limit falls, and when it falls below
        the next size up nothing in between is tried (on GPT-2 large, H100: 6 peaked at 21.1 GiB and 8 at
        22.7 against a 21.6 limit, so 7 was a trial spent to learn it ran over). After an OOM only the
        midpoint is known to be safe.
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
            mid = self._snap(max(lo + 1, _balanced(mid, self.per_rank)))
            if mid <= lo or mid >= hi or ceil_div(self.per_rank, mid) == ceil_div(self.per_rank, lo):
                return  # no micro-batch between them saves an accumulation step
            if not self._worth_trying(state, mid):
                return
            self._run(state, mid)

    def _edge_between(self, state: _RungState, lo: int, hi: int) -> int | None:
        """The largest micro-batch under the limit on the line through the peaks at `lo` (fitted) and `hi`
        (ran over the limit); None when `hi` ran out of memory, so its peak is unknown."""
        below = next(t for t in state.trials if t.micro_batch_size == lo)
        above = next(t for t in state.trials if t.micro_batch_size == hi)
        if above.outcome != "over_budget" or above.peak_bytes <= below.peak_bytes:
            return None
        return predict_max_micro_batch([(lo, below.peak_bytes), (hi, above.peak_bytes)], self.limit, self.cap)

    def _worth_trying(self, state: _RungState, micro: int) -> bool:
        """Whether a trial at `micro` could beat the best measured so far by more than noise.

        The rung's own time model (micro-step time ~ a + b x m, b >= 0, every micro-step charged as a full
        one, as trials are scored) is anchored at the rung's largest fitting trial. A larger micro-batch only
        raises the peak, and a plan within noise of the best is as good as the best: a trial predicted to gain
        less than that cannot improve the plan. One timed size gives no model: then it is worth a try.
        Asked only between or just past measured sizes (bisection, growth): a line through two nearby
        points extrapolated far is not a bound (on GPT-2 large, H100, such a line judged that optimizer
        offload could not win even at micro-batch 64; at 16 it was the fastest plan).
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

    def _snap(self, micro: int) -> int:
        """The largest allowed micro-batch not above `micro` (any size when `sizes` was not given)."""
        if self.sizes is None:
            return micro
        return max(s for s in self.sizes if s <= max(1, micro))

    def _run(self, state: _RungState, micro: int) -> Trial:
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
        return trial

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

    # -- choosing --------------------------------------------------------------------------------------
    def _best(self) -> Trial | None:
        ok = [t for t in self.trials if t.fits]
        if not ok:
            return None
        fastest = max(t.samples_per_second for t in ok)
        # Within noise of the fastest, prefer headroom: the lowest peak (PEERS.md lesson 5).
        close = [t for t in ok if t.samples_per_second >= fastest * (1 - NOISE)]
        return min(close, key=lambda t: (t.peak_bytes, -t.samples_per_second))

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
        """Re-measure a recompute win that recompute cannot explain, rather than believe it.

        Recomputing blocks only adds work: at the same or a smaller micro-batch, with the same offload and
        compile, a checkpointed configuration cannot beat one without checkpointing by more than noise.
        When it seems to (a neighbour took the CPU during the plain trial: "4.46x faster with checkpointing"
        on ResNet-18 at a roomy budget), both are measured again, longer; the re-measurements take the first
        ones' places in the record (their notes keep the first figures), and the pick is made again.
        """
        if self.remeasure is None or best.rung.checkpointing == "none":
            return best
        ok = [t for t in self.trials if t.fits]
        # (recompute, plain) pairs where the recompute trial ran at a micro-batch no larger and still won
        pairs = [(c, p) for c in ok if c.rung.checkpointing != "none" for p in ok if p.rung.checkpointing == "none"
                 and (p.rung.offload, p.rung.compile) == (c.rung.offload, c.rung.compile)
                 and c.micro_batch_size <= p.micro_batch_size and c.samples_per_second > p.samples_per_second * (1 + NOISE)]
        if not pairs:
            return best
        ckpt, plain = max(pairs, key=lambda cp: cp[0].samples_per_second / cp[1].samples_per_second)
        self.notes.append(
            f"{ckpt.rung.name} at micro-batch {ckpt.micro_batch_size} measured "
            f"{ckpt.samples_per_second / plain.samples_per_second:.2f}x {plain.rung.name} at micro-batch "
            f"{plain.micro_batch_size}, more than recompute can explain: both re-measured")
        for first in (ckpt, plain):
            again = self.remeasure(first.rung, first.micro_batch_size)
            note = f"re-measured; first {first.samples_per_second:,.1f} samples/s"
            self.trials[self.trials.index(first)] = dataclasses.replace(
                again, note=f"{again.note}; {note}" if again.note else note)
        return self._best() or best

    def _upper_bound(self, rung: Rung, states: list[_RungState]) -> float | None:
        """Optimistic samples/s for `rung`, from the time model of the rung holding the best trial."""
        best = self._best()
        if best is None:
            return None
        state = next((s for s in states if s.rung == best.rung), None)
        if state is None or len({m for m, _ in _timed(state)}) < 2:
            return None  # one point gives no time model: the higher rung may still win
        _, b = fit_line(_timed(state))
        # The line's slope, anchored at the largest measured micro-batch: beyond it each extra sample
        # costs at least b (b >= 0), and at it the time is what was measured, not what the fit says.
        top = max(state.ok, key=lambda t: t.micro_batch_size)
        # The optimizer step is the rung's own offload's where one was measured (optimizer offload's host
        # step is 10x the device one on GPT-2 large): a bound from another offload's would be wrong.
        opt = self._optimizer_seconds(rung.offload) or min(t.optimizer_seconds for t in state.ok)
        extra = MIN_OVERHEAD[rung.offload if rung.offload != "none" else rung.checkpointing]
        base_extra = MIN_OVERHEAD[best.rung.offload if best.rung.offload != "none" else best.rung.checkpointing]
        micro_seconds = (top.step_seconds + max(b, 0.0) * (self.cap - top.micro_batch_size)) * (1 + extra) / (1 + base_extra)
        per_step = global_step_seconds(micro_seconds, opt, self.per_rank, self.cap)
        return self.per_rank * self.world_size / per_step

    def _reason(self, best: Trial) -> str:
        plain = [t for t in self.trials if t.fits and t.rung.checkpointing == "none" and t.rung.offload == "none"
                 and not t.rung.compile]
        head = f"{best.rung.name} at micro-batch {best.micro_batch_size}"
        fitting = len({(t.rung, t.micro_batch_size) for t in self.trials if t.fits})
        others = [t for t in self.trials if t.fits and t.rung != best.rung]
        runner_up = max(others, key=lambda t: t.samples_per_second, default=None)
        second = ""
        if runner_up is not None:
            margin = best.samples_per_second / runner_up.samples_per_second
            second = (f"; {margin:.2f}x the runner-up, {runner_up.rung.name} at micro-batch "
                      f"{runner_up.micro_batch_size}")
        if best.rung.checkpointing == "none" and best.rung.offload == "none" and not best.rung.compile:
            return f"{head}: the fastest of {fitting} configurations that fit{second}"
        if plain:
            top = max(plain, key=lambda t: t.samples_per_second)
            return (f"{head}: {best.samples_per_second / top.samples_per_second:.2f}x the fastest plan without "
                    f"checkpointing, offload or compile (micro-batch {top.micro_batch_size}){second}")
        if runner_up is not None:  # say what happened to the others: they fitted, only slower
            return (f"{head}: none without checkpointing, offload or compile fits under the limit "
                    f"({format_bytes(self.limit)}); {runner_up.rung.name} at micro-batch "
                    f"{runner_up.micro_batch_size} fitted but {margin:.2f}x slower")
        return f"{head}: nothing lighter fits under the limit ({format_bytes(self.limit)})"

    def _nothing_fits(self, rungs: Sequence[Rung]) -> str:
        ran = [t for t in self.trials if t.peak_bytes]
        smallest = min(ran, key=lambda t: t.peak_bytes) if ran else None
        tried = "; ".join(f"{t.rung.name} @ {t.micro_batch_size}: {t.outcome}" for t in self.trials)
        seen = (f"the smallest peak seen was {format_bytes(smallest.peak_bytes)} ({smallest.rung.name} at "
                f"micro-batch {smallest.micro_batch_size})" if smallest else "no trial got far enough to measure a peak")
        skipped = "".join(f" {n}." for n in self.notes)  # why rungs were left out, or the trial budget ran out
        return (f"no configuration fits under {format_bytes(self.limit)} (the budget less the margin) even at "
                f"micro-batch 1 on the top rung ({rungs[-1].name if rungs else 'none'}); {seen}. "
                f"Tried: {tried}.{skipped} {self.advice}")


def _balanced(micro: int, per_rank: int) -> int:
    """The smallest micro-batch needing as few accumulation steps as `micro`: same speed, more headroom."""
    steps = ceil_div(per_rank, max(1, micro))
    return ceil_div(per_rank, steps)


@dataclass(frozen=True, kw_only=True)
class _Compiled:
    """What compile did beside an eager trial at the same size: bytes per sample and step time, as ratios."""

    memory: float
    time: float


def _activations(rung: Rung) -> tuple[str, str, int | None, bool, bool]:
    """What sets the bytes each sample adds: precision, blocks recomputed, compile, activation offload."""
    return rung.precision, rung.checkpointing, rung.checkpointed_blocks, rung.compile, rung.offload == "activations"


def _timed(state: _RungState) -> list[tuple[int, float]]:
    """(micro-batch, micro-step seconds) of every trial that ran all its steps, over the limit or not."""
    return [(t.micro_batch_size, t.step_seconds) for t in state.trials
            if t.outcome in ("ok", "over_budget") and t.step_seconds > 0]


def _ruled_out(candidate: tuple[Rung, int, float], missed: Rung, micro: int) -> bool:
    """Whether a miss of `missed` at `micro` samples says `candidate` would run over too: the same offload
    and compile, no more blocks recomputed, at least as many samples."""
    rung, m, _ = candidate
    same = (rung.offload, rung.compile, rung.precision) == (missed.offload, missed.compile, missed.precision)
    return same and (rung.checkpointed_blocks or 0) <= (missed.checkpointed_blocks or 0) and m >= micro


def _blocks_needed(floor: float, s0: float, sn: float, n: int, micro: int, limit: int, compiled: float,
                   shares: tuple[float, ...] | None = None) -> int | None:
    """The fewest of `n` blocks to recompute so `micro` samples fit: each recomputed block drops its share of
    (s0 - sn) bytes per sample (`shares[k]` for the first k, by the activations they hold; else k/n);
    compile scales what the non-recomputed blocks keep. None if even all fail."""
    for k in range(n + 1):
        frac = (shares[k] if shares is not None and len(shares) == n + 1 else k / n) if n else 0.0
        per_sample = compiled * (1 - frac) * s0 + frac * sn if compiled < 1 else (1 - frac) * s0 + frac * sn
        if floor + micro * per_sample <= limit:
            return k
    return None
