"""Step: compile with blocks recomputed. Decides whether compiling a recompute configuration beats everything
measured: the fastest eager recompute configuration is compiled at its micro-batch (one trial, a size down
after a miss), which measures what compile saves with recompute on (`Ledger.compiled_recompute`); from that
ratio the compiled block count and micro-batch predicted fastest are run (`placement.try_best`)."""

from __future__ import annotations

import dataclasses

from ..configuration import WHOLE_BLOCK
from .ledger import Compiled, Ledger
from .lines import accumulation_sizes, bytes_per_sample, rung_state, step_line
from .measure import budget_left, measure
from .placement import candidates_for, one_sample_left, try_best


def place_compiled_recompute(s: Ledger) -> Ledger:
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
    if (not s.lattice.compile or s.compile_failed or s.lattice.blocks < 1
            or not budget_left(s)):
        return s
    # Only where recompute lets a micro-batch grow past what compile without it reached: recompute itself
    # only adds work.
    reach = max((t.micro_batch_size for t in s.trials if t.fits and t.rung.compile
                 and not t.rung.checkpointed_blocks), default=0)
    # (a block compiled inside its checkpoint recomputes whole: see `Rung.recompute_policy`)
    eager = [t for t in s.trials if t.fits and t.rung.checkpointed_blocks and not t.rung.compile
             and t.rung.recompute_policy == WHOLE_BLOCK and t.rung.offload in ("none", "optimizer")
             and t.step_seconds > 0 and t.micro_batch_size > reach]
    if not eager:
        return s
    base = max(eager, key=lambda t: t.samples_per_second)
    state = rung_state(s, dataclasses.replace(base.rung, compile=True))
    first = next((t for t in state.trials if t.micro_batch_size == base.micro_batch_size), None)
    first = first or measure(s, state, base.micro_batch_size)
    if first.outcome == "error":
        s.notes.append(f"compile with blocks recomputed failed ({first.note}); not tried again")
        return s
    if not first.fits and budget_left(s):
        # Compile's workspaces raise the floor (GPT-2 large: 1.6 GiB): once down by what the miss was
        # over, at eager recompute's bytes per sample; one size down after an OOM (no peak to go by).
        slope = bytes_per_sample(s, base.rung)
        over = first.peak_bytes - s.limit if first.outcome == "over_budget" and slope else 0
        smaller = [m for m in accumulation_sizes(s) if m < first.micro_batch_size and not one_sample_left(s, m)
                   and (not over or not slope or m <= first.micro_batch_size - over / slope)]
        if smaller:
            first = measure(s, state, max(smaller))
    line = step_line(s, base.rung)
    if not first.fits or first.step_seconds <= 0 or line is None:
        return s
    eager_seconds = line[0] + line[1] * first.micro_batch_size  # eager recompute at the same size
    # Where nothing fitted without recompute, compile's bytes per sample were never measured: taken as
    # eager's (compile only lowers them), so the candidates below are never predicted to fit too much.
    memory = s.compiled.memory if s.compiled is not None else 1.0
    measured = Compiled(memory=memory, time=first.step_seconds / max(eager_seconds, 1e-9))
    s.compiled_recompute = measured
    candidates = [c for offload in ("none", "optimizer") if any(st.rung.offload == offload for st in s.states)
                  for c in candidates_for(s, offload, compiled=measured) if c[0].checkpointed_blocks]
    try_best(s, candidates, "compile with blocks recomputed")
    return s
