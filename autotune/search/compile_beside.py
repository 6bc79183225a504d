"""Step: compile beside the fastest eager configuration without recompute. Decides whether compile pays, once
per search: one trial at the largest micro-batch eager fitted measures what compile saves in time and bytes
per sample (`Ledger.compiled`); from it, the compiled configuration is grown along its own memory line, and
tried with the other offload choice where those savings predict a win."""

from __future__ import annotations

import dataclasses

from ..configuration import Rung
from ..evidence import Trial
from .explore import verify
from .ledger import Compiled, Ledger
from .lines import resident_floor, rung_state, snap
from .measure import budget_left, measure
from .placement import candidates_for, next_size, one_sample_left, try_best


def place_compile(s: Ledger) -> Ledger:
    """Compile where it can win, measured once per search: first at the largest micro-batch that fitted
    eager with no recompute (compile only lowers memory, so it fits there), which measures what compile
    saves in time and bytes; then at the largest micro-batch that saving predicts to fit, and from the
    two points on, along the compiled configuration's own memory line (grow or bisect, as any rung).

    Compiled configurations placed here recompute no block, and keep the probe's offload unless compile's
    measured savings predict a win with the other one (`compile_other_offload`); compile with blocks
    recomputed comes after the recompute rungs are measured (`compiled_recompute.py`). One point does
    not tell compile's floor from its bytes per sample (on GPT-2 large its workspaces raised the floor
    by 1.6 GiB while each sample took 0.38x the bytes), hence the second point before any growth.
    """
    if not s.lattice.compile or s.compile_failed or s.compiled is not None or not budget_left(s):
        return s
    probe = compile_probe(s)
    if probe is None:
        return s
    eager, rung, micro = probe
    state = rung_state(s, rung)
    first = measure(s, state, micro)
    if first.outcome == "error":
        s.compile_failed = True
        s.notes.append(f"compile failed ({first.note}); the plan stays eager")
        return s
    if not first.fits or first.step_seconds <= 0:
        return s
    floor = resident_floor(s, eager.rung) or 0.0
    ratio = (first.peak_bytes - floor) / max(1.0, eager.peak_bytes - floor)
    s.compiled = Compiled(memory=min(1.0, max(0.05, ratio)), time=first.step_seconds / eager.step_seconds)
    sizes = [m for r, m, _ in candidates_for(s, rung.offload, compiled=s.compiled) if r.checkpointed_blocks == 0]
    # No prediction at all where the eager line is unknown (eager fitted one sample and ran out of memory
    # at two, its peak unseen): one size up on compile's own terms, after
    # which its own two points decide, as for any rung (grow, or bisect after a miss).
    guess = max(sizes) if sizes else next_size(s, first.micro_batch_size)
    if guess > first.micro_batch_size and budget_left(s):
        verify(s, state, guess)
    compile_other_offload(s, rung.offload)
    return s


def compile_other_offload(s: Ledger, measured: str) -> None:
    """Compile with the other of no offload and optimizer offload, where what compile saved beside the
    probe (time and bytes per sample, as ratios) predicts it beats the best by more than noise.

    Which offload leads eager need not lead compiled: compile shrinks what each sample holds, so the
    micro-batch each offload reaches, and with it what optimizer offload's host step costs a sample,
    changes: eager optimizer offload can lead while compile without offload is the faster plan. Per-block
    compile makes the other offload's new graph (its parameters' dtype differs) seconds of compiling, not
    the minutes of whole-model compile.
    """
    other = "none" if measured == "optimizer" else "optimizer" if measured == "none" else ""
    if s.compiled is None or not other or not budget_left(s):
        return
    candidates = [c for c in candidates_for(s, other, compiled=s.compiled) if c[0].checkpointed_blocks == 0]
    try_best(s, candidates, f"compile with {'optimizer offload' if other == 'optimizer' else 'no offload'}")


def compile_probe(s: Ledger) -> tuple[Trial, Rung, int] | None:
    """The eager trial compile is first measured beside, the compiled rung, and the size to run it at:
    the fastest eager configuration without recompute, at its largest micro-batch that leaves no
    one-sample last micro-batch (a size compile specializes: a second graph to compile)."""
    ok = [t for t in s.trials if t.fits and not t.rung.compile and t.rung.offload in ("none", "optimizer")]
    bare = [t for t in ok if t.rung.checkpointing == "none"]
    if not bare:
        return None
    leader = max(bare, key=lambda t: t.samples_per_second).rung
    eager = max((t for t in bare if t.rung == leader), key=lambda t: t.micro_batch_size)
    micro = max(m for m in range(1, eager.micro_batch_size + 1) if not one_sample_left(s, m))
    return eager, dataclasses.replace(leader, compile=True), snap(s, micro)
