"""Under optimizer offload on one process: whether the host steps during the last backward, and what the
plan then promises.

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
from .trial import retimed


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
