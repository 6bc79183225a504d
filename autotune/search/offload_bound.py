"""What offloading can still win over its base, the same configuration with nothing offloaded.

Offloading (the optimizer state, or saved activations) adds work to every step: copies, a host optimizer
step. Its only gain is room: a micro-batch larger than its base fits, so fewer micro-steps carry the fixed
cost of each. Where the base has measured a time line (micro-step ~ a + b x m, two sizes or more), that line
bounds the offloading configuration at every micro-batch: each micro-step takes at least the base's time at
that size, and each sample past one the offloading configuration measured adds at least the base's slope.
When even the largest micro-batch, at that bound, is not faster than the base already measured by more than
noise (a plan within noise of another is as good), the offloading configuration is not run (before its first
trial) or not grown (after it): on GPT-2 large at 24 GiB, activation offload at micro-batch 32 is bounded at
25.3 samples/s beside its base's 25.2 at 16, and its trial would take 11 of the tune's seconds.

The optimizer step is bounded by the base's (on the device): a partial host share (`offload_share.py`) can
leave most of it there, so a bound with the host's whole step would rule out a share that wins. An offload that
copies in every micro-step (the recomputed blocks' inputs, or what the other blocks save) adds at least its
least cost per sample (`lines.MIN_OVERHEAD`, as the bound from the best trial charges it) to each micro-step;
optimizer offload adds nothing there. On W1 the least cost alone rules out activation offload before its first
trial, which measured 16% slower than its base at the same micro-batch.
"""

from __future__ import annotations

import dataclasses

from ..configuration import Rung
from ..evidence import Trial
from ..workload.batching import fit_line, global_step_seconds
from .ledger import Ledger, RungState
from .lines import MIN_OVERHEAD, NOISE, accumulation_sizes, timed


def base(s: Ledger, rung: Rung) -> RungState | None:
    """The measured base of an offloading `rung` (its configuration with nothing offloaded) where its trials
    give a time line, else None (no offload, the base not measured, or measured at one size only)."""
    if rung.offload == "none":
        return None
    plain = dataclasses.replace(rung, offload="none")
    state = next((st for st in s.states if st.rung == plain), None)
    if state is None or not state.ok or len({m for m, _ in timed(state)}) < 2:
        return None
    return state


def bound(s: Ledger, rung: Rung, start: Trial | None = None) -> float | None:
    """The most samples/s `rung` can reach by its base's time line, over every micro-batch the search may try
    above its own measured `start` (or above the base's largest, before `rung` ran); None without a base.
    `start` counts too, as measured."""
    st = base(s, rung)
    if st is None:
        return None
    a, b = fit_line(timed(st))
    a, b = max(a, 0.0), max(b, 0.0)
    top = start or max(st.ok, key=lambda t: t.micro_batch_size)
    opt = min(t.optimizer_seconds for t in st.ok)
    copies = 1.0 + (MIN_OVERHEAD[rung.offload] if rung.offload != "optimizer" else 0.0)  # per micro-step
    rates = [start.samples_per_second] if start is not None and start.fits else []
    edge = top.micro_batch_size
    for m in accumulation_sizes(s):
        if m <= edge and start is not None:
            continue
        least = copies * (a + b * m if m < edge else max(a + b * m, top.step_seconds + b * (m - edge)))
        rates.append(s.per_rank * s.world_size / global_step_seconds(max(least, 1e-9), opt, s.per_rank, m))
    return max(rates, default=None)


def cannot_win(s: Ledger, rung: Rung, start: Trial | None = None) -> str | None:
    """Why `rung` need not be run (`start` None) or grown past `start`: a note for the reason, or None where it
    may still beat its base by more than noise."""
    st = base(s, rung)
    limit = bound(s, rung, start)
    if st is None or limit is None:
        return None
    best = max(st.ok, key=lambda t: t.samples_per_second)
    if limit > best.samples_per_second * (1 + NOISE):
        return None
    where = f"past micro-batch {start.micro_batch_size}" if start is not None else "at any micro-batch"
    return (f"{rung.name} not {'grown' if start is not None else 'tried'}: {where} at most {limit:,.1f} samples/s "
            f"by {best.rung.name}'s time line, not more than noise above its {best.samples_per_second:,.1f} at "
            f"micro-batch {best.micro_batch_size} (offloading only adds to a step)")
