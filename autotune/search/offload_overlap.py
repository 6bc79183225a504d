"""Step after the pick, under optimizer offload on one process: the offload overlap. Decides whether the host
steps during the last backward, and what the plan then promises (`overlap`).

Only the last micro-batch's backward and the optimizer tail differ between the two ways, so one trial of the
chosen configuration with its measured steps overlapped is compared with the chosen (serial) one on step +
optimizer seconds, not on whole-batch estimates. Neither wins everywhere: overlap saves a little where a long
recomputed backward hides host work, and costs a little on a compiled step whose launches the host optimizer's
threads slow (benchmarks/bench_trial_accuracy.py measures both). Streamed to the GPU
(techniques/offload/streamed.py), the same choice: its segments issued during the last backward, or all after it.

The estimate moves with the choice: left at the serial trial's, it would price a step the plan does not
train, and promise less than the plan then trains.
"""

from __future__ import annotations

from ..evidence import Trial
from ..sizes import format_bytes
from ..techniques.offload import overlap_default
from ..techniques.offload.streamed import streams
from . import host_budget
from .ledger import Ledger
from .trial import retimed


def overlap(s: Ledger) -> Ledger:
    """Step: whether the host steps during the last backward, by one trial of the pick with its measured steps
    overlapped (`choose`). Leaves `s.overlap` None where it is not a choice (no host optimizer, several ranks,
    FSDP2 shards, the overlap turned off); serial, unmeasured, where overlapped the host would hold more than
    the host budget."""
    best, ctx = s.picked(), s.afterwards()
    work, fraction = ctx.work, s.fraction or 1.0
    if best.rung.offload != "optimizer" or work.world_size != 1 or ctx.sharded or not overlap_default():
        return s
    need = host_budget.need(best.rung, work.model, work.spec, work.placement.kind, fraction=fraction, overlap=True,
                            snapshot=work.snapshot_in_ram)
    if work.host_limit_bytes is not None and need.total > work.host_limit_bytes:
        s.found("offload overlap", f"serial optimizer offload: overlapped, the host would hold "
                f"{format_bytes(need.total)}, over the host budget of {format_bytes(work.host_limit_bytes)}")
        s.overlap = False
        return s
    other = ctx.run(best.rung, best.micro_batch_size, offload_fraction=fraction, overlap=True)
    s.trials.append(other)
    streamed = streams(work.placement.kind, work.spec.cls_name, best.rung.precision)
    s.pick, s.overlap, clause = choose(best, other, work.per_rank, streamed)
    s.found("offload overlap", clause)
    return s


def choose(best: Trial, overlapped: Trial, per_rank: int, streamed: bool) -> tuple[Trial, bool, str]:
    """(the trial to plan from, `plan.offload_overlap`, a clause for the plan's reason), from `overlapped`: a
    trial of `best`'s configuration with its measured steps overlapped. Overlapped, `best` with its
    once-a-step part shortened by what the overlap saved, and its rate estimated again; serial, `best`."""
    kind = "streamed optimizer offload" if streamed else "optimizer offload"
    serial_s = best.step_seconds + best.optimizer_seconds
    overlapped_s = overlapped.step_seconds + overlapped.optimizer_seconds
    # Streamed, the overlap allocates nothing the serial step does not (its buffers exist either way: the same
    # bytes allocated at the peak both ways), so a peak over the limit is the allocator's cache laid out
    # differently in this trial: the plan keeps the serial trial's peak, and only the time decides.
    fits = overlapped.fits or (streamed and overlapped.outcome == "over_budget")
    if not fits:
        return best, False, f"serial {kind}: the overlapped trial: {overlapped.outcome}"
    measured = f"the last micro-batch and the optimizer took {overlapped_s:.3f} s overlapped, {serial_s:.3f} s serial"
    if overlapped_s >= serial_s:
        return best, False, f"serial {kind}: {measured}"
    moved = retimed(best, max(0.0, best.optimizer_seconds - (serial_s - overlapped_s)), per_rank, 1)
    return moved, True, f"overlapped {kind}: {measured}"
