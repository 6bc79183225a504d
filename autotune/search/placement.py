"""The lattice beyond the anchors: intermediate block counts, compile, and compile with blocks recomputed,
each placed where the measured lines predict it can win, then verified by a trial."""

from __future__ import annotations

import dataclasses

from ..configuration import RECOMPUTE_POLICIES, WHOLE_BLOCK, Rung
from ..evidence import Trial
from ..workload.batching import global_step_seconds
from .climb import Climb
from .lines import MAX_PLACED, NOISE, Compiled


class Placing(Climb):
    """Placing configurations between and beyond the anchors (a part of `Controller`).

    Large: the count takes in the climb and the lines it builds on (climb.py, lines.py): placing verifies each
    predicted configuration by the climb's trial and predicts from the lines' measurements, all on the
    controller's one set of trials and rung states.
    """

    _compiled: Compiled | None
    _compiled_recompute: Compiled | None
    _compile_failed: bool

    def _place_blocks(self) -> None:
        """Per offload, the fewest recomputed blocks that let a faster micro-batch fit, predicted from the
        bytes per sample measured with none and with all blocks recomputed, then verified; whole blocks
        recomputed or keeping their matmuls (each `recompute_policy` measured with all blocks), whichever
        is predicted fastest."""
        n = self.lattice.blocks
        if n < 2:
            return
        for offload in ("none", "optimizer"):
            if not any(s.rung.offload == offload and not s.rung.compile for s in self.states):
                continue
            # (all blocks keeping their matmuls is an anchor without offload only)
            candidates = [c for policy in RECOMPUTE_POLICIES for c in self._candidates(offload, None, policy=policy)
                          if 0 < (c[0].checkpointed_blocks or 0) < n
                          or (c[0].checkpointed_blocks == n and c[0].recompute_policy != WHOLE_BLOCK)]
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
        self._compiled = Compiled(memory=min(1.0, max(0.05, ratio)), time=first.step_seconds / eager.step_seconds)
        sizes = [m for r, m, _ in self._candidates(rung.offload, compiled=self._compiled) if r.checkpointed_blocks == 0]
        # No prediction at all where the eager line is unknown (eager fitted one sample and ran out of memory
        # at two, its peak unseen): one size up on compile's own terms, after
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
        recompute runs fused kernels too, and what compile saves depends on the micro-batch: at one sample a
        step can be launch-bound (many micro-steps of guards and calls) and compile slower than eager, while
        with every block recomputed at a larger micro-batch it can nearly halve the step, beating compile
        without recompute too. So the ratio measured without recompute, at the small micro-batch compile
        fitted, does not predict this one; it is measured where it applies. Where nothing fitted without
        recompute at all (a 3B model at 24 GiB), compile is first tried here.
        """
        if (not self.lattice.compile or self._compile_failed or self.lattice.blocks < 1
                or not self._budget_left()):
            return
        # Only where recompute lets a micro-batch grow past what compile without it reached: recompute itself
        # only adds work.
        reach = max((t.micro_batch_size for t in self.trials if t.fits and t.rung.compile
                     and not t.rung.checkpointed_blocks), default=0)
        # (a block compiled inside its checkpoint recomputes whole: see `Rung.recompute_policy`)
        eager = [t for t in self.trials if t.fits and t.rung.checkpointed_blocks and not t.rung.compile
                 and t.rung.recompute_policy == WHOLE_BLOCK and t.rung.offload in ("none", "optimizer")
                 and t.step_seconds > 0 and t.micro_batch_size > reach]
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
                       and (not over or not slope or m <= first.micro_batch_size - over / slope)]
            if smaller:
                first = self._run(state, max(smaller))
        line = self._step_line(base.rung)
        if not first.fits or first.step_seconds <= 0 or line is None:
            return
        eager_seconds = line[0] + line[1] * first.micro_batch_size  # eager recompute at the same size
        # Where nothing fitted without recompute, compile's bytes per sample were never measured: taken as
        # eager's (compile only lowers them), so the candidates below are never predicted to fit too much.
        memory = self._compiled.memory if self._compiled is not None else 1.0
        measured = Compiled(memory=memory, time=first.step_seconds / max(eager_seconds, 1e-9))
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
        return sorted(self._candidates(like.offload, compiled, int(self.limit + freed)), key=lambda c: -c[2])

    def _compile_other_offload(self, measured: str) -> None:
        """Compile with the other of no offload and optimizer offload, where what compile saved beside the
        probe (time and bytes per sample, as ratios) predicts it beats the best by more than noise.

        Which offload leads eager need not lead compiled: compile shrinks what each sample holds, so the
        micro-batch each offload reaches, and with it what optimizer offload's host step costs a sample,
        changes: eager optimizer offload can lead while compile without offload is the faster plan. Per-block
        compile makes the other offload's new graph (its parameters' dtype differs) seconds of compiling, not
        the minutes of whole-model compile.
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
        ok = [t for t in self.trials if t.fits and not t.rung.compile and t.rung.offload in ("none", "optimizer")]
        bare = [t for t in ok if t.rung.checkpointing == "none"]
        if not bare:
            return None
        leader = max(bare, key=lambda t: t.samples_per_second).rung
        eager = max((t for t in bare if t.rung == leader), key=lambda t: t.micro_batch_size)
        micro = max(m for m in range(1, eager.micro_batch_size + 1) if not self._one_sample_left(m))
        return eager, dataclasses.replace(leader, compile=True), self._snap(micro)

    def _candidates(self, offload: str, compiled: Compiled | None, limit: int | None = None,
                    policy: str = WHOLE_BLOCK) -> list[tuple[Rung, int, float]]:
        """(rung, micro-batch, predicted samples/s) for each accumulation count: the fewest blocks
        recomputed that fit that micro-batch by the measured lines, for `offload`, eager or compiled, under
        `limit` (default the search's), the blocks keeping what `policy` keeps (eager only).

        Compiled, the blocks not recomputed follow compile's own measured line where it has one (bytes and
        time per sample), else eager's scaled by what compile saved; the recomputed ones follow eager full
        recompute's, its time scaled by compile's ratio. (GPT-2 XL at 16 GiB: eager fits one sample, so only
        compile's line says what its blocks keep.)"""
        n = self.lattice.blocks
        precision = self.states[0].rung.precision
        lo = Rung(precision=precision, offload=offload, checkpointed_blocks=0)
        hi = dataclasses.replace(lo, checkpointing="full", checkpointed_blocks=n, recompute_policy=policy) if n else lo
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
        if s0 is None or floor is None or opt is None or t0 is None:
            return []
        if sn is None or tn is None:  # recompute not measured yet: only configurations without it
            n, sn, tn = 0, s0, t0
        out = []
        for micro in self._sizes():
            if compiled is not None and self._one_sample_left(micro):
                continue  # a last micro-batch of one sample is a shape compile specializes: a recompile
            k = blocks_needed(floor, s0, sn, n, micro, self.limit if limit is None else limit, memory,
                              self.lattice.shares)
            if k is None:
                continue
            label = "none" if k == 0 else "full" if k == self.lattice.blocks else "selective"
            rung = dataclasses.replace(lo, checkpointing=label, checkpointed_blocks=k, compile=compiled is not None,
                                       recompute_policy=policy if k else WHOLE_BLOCK)
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
            pool = [c for c in pool if not ruled_out(c, rung, micro)]


def ruled_out(candidate: tuple[Rung, int, float], missed: Rung, micro: int) -> bool:
    """Whether a miss of `missed` at `micro` samples says `candidate` would run over too: the same offload
    and compile and recompute policy, no more blocks recomputed, at least as many samples."""
    rung, m, _ = candidate
    same = ((rung.offload, rung.compile, rung.precision, rung.recompute_policy)
            == (missed.offload, missed.compile, missed.precision, missed.recompute_policy))
    return same and (rung.checkpointed_blocks or 0) <= (missed.checkpointed_blocks or 0) and m >= micro


def blocks_needed(floor: float, s0: float, sn: float, n: int, micro: int, limit: int, compiled: float,
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
