"""The lattice beyond the anchors, predicted: for an offload, eager or compiled, the fewest blocks recomputed
that fit each micro-batch by the measured lines and the rate each would reach (`candidates_for`), and the
fastest of those run and grown (`try_best`), the misses ruling out what they prove cannot fit. The placing
steps (`blocks.py`, `compile_beside.py`, `compiled_recompute.py`) and the partitioned-state step ask it."""

from __future__ import annotations

import dataclasses

from ..configuration import WHOLE_BLOCK, Rung
from ..workload.batching import global_step_seconds
from .explore import bisect, grow
from .ledger import Compiled, Ledger
from .lines import (
    MAX_PLACED,
    NOISE,
    accumulation_sizes,
    best_so_far,
    bytes_per_sample,
    optimizer_seconds,
    resident_floor,
    rung_state,
    step_line,
)
from .measure import budget_left, measure
from .offload_overlap import hidden_host_step, may_hide_host_step


def with_room(s: Ledger, like: Rung, freed: float) -> list[tuple[Rung, int, float]]:
    """(rung, micro-batch, predicted samples/s), fastest first: what `like`'s offload and compile would fit
    with `freed` more bytes under the limit, by the measured lines, each at the fewest blocks recomputed
    for its micro-batch (search/partitioned_state.py asks, once the optimizer state it would partition
    over the ranks has been measured to free that much)."""
    compiled = (s.compiled_recompute or s.compiled) if like.compile else None
    if like.compile and compiled is None:
        return []
    return sorted(candidates_for(s, like.offload, compiled, int(s.limit + freed)), key=lambda c: -c[2])


def next_size(s: Ledger, micro: int) -> int:
    """The next micro-batch above `micro` that saves an accumulation step and leaves no one-sample last
    micro-batch (a size compile specializes); `micro` when there is none."""
    larger = [m for m in accumulation_sizes(s) if m > micro and not one_sample_left(s, m)]
    return min(larger, default=micro)


def one_sample_left(s: Ledger, micro: int) -> bool:
    """Whether splitting the per-rank batch at `micro` leaves a last micro-batch of one sample: a size
    compile specializes, so a second graph to compile."""
    return micro > 1 and s.per_rank % micro == 1


def candidates_for(s: Ledger, offload: str, compiled: Compiled | None, limit: int | None = None,
                   policy: str = WHOLE_BLOCK) -> list[tuple[Rung, int, float]]:
    """(rung, micro-batch, predicted samples/s) for each accumulation count: the fewest blocks
    recomputed that fit that micro-batch by the measured lines, for `offload`, eager or compiled, under
    `limit` (default the search's), the blocks keeping what `policy` keeps (eager only).

    Compiled, the blocks not recomputed follow compile's own measured line where it has one (bytes and
    time per sample), else eager's scaled by what compile saved; the recomputed ones follow eager full
    recompute's, its time scaled by compile's ratio. (GPT-2 XL at 16 GiB: eager fits one sample, so only
    compile's line says what its blocks keep.)"""
    n = s.lattice.blocks
    precision = s.states[0].rung.precision
    lo = Rung(precision=precision, offload=offload, checkpointed_blocks=0)
    hi = dataclasses.replace(lo, checkpointing="full", checkpointed_blocks=n, recompute_policy=policy) if n else lo
    s0 = bytes_per_sample(s, lo) or bytes_per_sample(s, dataclasses.replace(lo, offload="none"))
    sn = (bytes_per_sample(s, hi) or bytes_per_sample(s, dataclasses.replace(hi, offload="none"))) if n else s0
    floor = resident_floor(s, lo)
    opt = optimizer_seconds(s, offload)
    t0 = step_line(s, lo)
    tn = step_line(s, hi) if n else t0
    time0 = timen = compiled.time if compiled else 1.0
    memory = compiled.memory if compiled else 1.0
    if compiled is not None:
        lo_c = dataclasses.replace(lo, compile=True)
        own_slope, own_line = bytes_per_sample(s, lo_c), step_line(s, lo_c)
        if own_slope is not None and own_line is not None:
            s0, t0, memory, time0 = own_slope, own_line, 1.0, 1.0
    if s0 is None or floor is None or opt is None or t0 is None:
        return []
    if sn is None or tn is None:  # recompute not measured yet: only configurations without it
        n, sn, tn = 0, s0, t0
    # A streamed host step, measured serially, is priced as the offload-overlap step may hide it behind the last
    # backward: this only decides what is worth a trial, and the pick's offload rival is measured overlapped.
    hides = offload == "optimizer" and may_hide_host_step(s, precision)
    out = []
    for micro in accumulation_sizes(s):
        if compiled is not None and one_sample_left(s, micro):
            continue  # a last micro-batch of one sample is a shape compile specializes: a recompile
        k = blocks_needed(floor, s0, sn, n, micro, s.limit if limit is None else limit, memory,
                          s.lattice.shares)
        if k is None:
            continue
        label = "none" if k == 0 else "full" if k == s.lattice.blocks else "selective"
        rung = dataclasses.replace(lo, checkpointing=label, checkpointed_blocks=k, compile=compiled is not None,
                                   recompute_policy=policy if k else WHOLE_BLOCK)
        frac = k / n if n else 0.0
        seconds = (1 - frac) * (t0[0] + t0[1] * micro) * time0 + frac * (tn[0] + tn[1] * micro) * timen
        once = hidden_host_step(opt, seconds) if hides else opt
        rate = s.per_rank * s.world_size / global_step_seconds(max(seconds, 1e-9), once, s.per_rank, micro)
        out.append((rung, micro, rate))
    return out


def try_best(s: Ledger, candidates: list[tuple[Rung, int, float]], what: str) -> None:
    """Run the candidate predicted fastest, if it can beat the best by more than noise and was not
    measured; after a miss, the next one the miss does not rule out (one with fewer blocks recomputed
    at as many samples would run over too); after a fit, grow it along its own memory line."""
    measured = {(t.rung, t.micro_batch_size) for t in s.trials}
    pool = sorted((c for c in candidates if (c[0], c[1]) not in measured), key=lambda c: -c[2])
    for _ in range(MAX_PLACED):
        best = best_so_far(s)
        if not pool or best is None or not budget_left(s):
            return
        rung, micro, rate = pool.pop(0)
        if rate <= best.samples_per_second * (1 + NOISE):
            s.notes.append(f"{what}: no configuration predicted above the {best.samples_per_second:,.1f} "
                           f"samples/s measured (best {rung.name} @ {micro}: {rate:,.1f})")
            return
        state = rung_state(s, rung)
        trial = measure(s, state, micro)
        if trial.fits:
            if len({t.micro_batch_size for t in state.ok}) >= 2:
                grow(s, state)
            return
        if trial.outcome == "error":
            return
        if state.ok:  # a smaller size of this configuration fitted: the edge lies between the two
            bisect(s, state)
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
