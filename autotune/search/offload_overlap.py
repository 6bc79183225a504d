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

import dataclasses
from collections.abc import Callable

from ..evidence import Trial
from ..sizes import format_bytes
from ..techniques.offload import overlap_default
from ..techniques.offload.streamed import streams
from ..workload.batching import global_step_seconds
from . import host_budget
from .ledger import Ledger
from .lines import NOISE
from .trial import retimed


def overlap(s: Ledger) -> Ledger:
    """Step: whether the host steps during the last backward, by one trial of the pick with its measured steps
    overlapped (`choose`). Leaves `s.overlap` None where it is not a choice (no host optimizer, several ranks,
    FSDP2 shards, the overlap turned off); serial, unmeasured, where overlapped the host would hold more than
    the host budget. Where the pick offloads nothing, its streamed offload rival is measured overlapped instead
    (`overlapped_rival`)."""
    best, ctx = s.picked(), s.afterwards()
    work, fraction = ctx.work, s.fraction or 1.0
    if work.world_size != 1 or ctx.sharded or not overlap_default():
        return s
    if best.rung.offload != "optimizer":
        return overlapped_rival(s)
    over = _over_host_budget(s, best, fraction)
    if over:
        s.found("offload overlap", f"serial optimizer offload: {over}")
        s.overlap = False
        return s
    other = ctx.run(best.rung, best.micro_batch_size, offload_fraction=fraction, overlap=True)
    s.trials.append(standing_for(best, other, work.per_rank))
    streamed = streams(work.placement.kind, work.spec.cls_name, best.rung.precision)
    s.pick, s.overlap, clause = choose(best, other, work.per_rank, streamed)
    s.found("offload overlap", clause)
    return s


def overlapped_rival(s: Ledger) -> Ledger:
    """Where the pick offloads nothing: the offload trial that the overlap could make fastest (`hidden_host_step`)
    measured overlapped, and taken as the pick where that beats it by more than noise. The search measures a
    streamed offload serially, so an offloaded configuration can lose the pick by a host step the overlap would
    mostly hide (GPT-2 large at 24 GiB: 0.27 s a step, beside 1.1 s of micro-steps)."""
    best, ctx = s.picked(), s.afterwards()
    work = ctx.work
    kind, optimizer = work.placement.kind, work.spec.cls_name
    offloaded = [t for t in s.trials if t.fits and t.rung.offload == "optimizer" and t.step_seconds > 0
                 and streams(kind, optimizer, t.rung.precision)]
    if not offloaded:
        return s
    rival = max(offloaded, key=lambda t: overlapped_rate(t, work.per_rank))
    if overlapped_rate(rival, work.per_rank) <= best.samples_per_second * (1 + NOISE):
        return s
    fraction = ctx.host_shares.get(rival.rung, 1.0)
    name = f"{rival.rung.name} at micro-batch {rival.micro_batch_size}"
    over = _over_host_budget(s, rival, fraction)
    if over:
        s.notes.append(f"{name} not measured overlapped: {over}")
        return s
    other = ctx.run(rival.rung, rival.micro_batch_size, offload_fraction=fraction, overlap=True)
    s.trials.append(standing_for(rival, other, work.per_rank))
    moved, overlaps, clause = choose(rival, other, work.per_rank, streamed=True)
    if not overlaps or moved.samples_per_second <= best.samples_per_second * (1 + NOISE):
        s.notes.append(f"{name} measured overlapped: {moved.samples_per_second:,.1f} samples/s, not faster than the "
                       f"pick ({clause})")
        return s
    s.found("offload overlap", f"{name}, its host step overlapped with the last backward: "
            f"{moved.samples_per_second / best.samples_per_second:.2f}x {best.rung.name} at micro-batch "
            f"{best.micro_batch_size} ({clause})", leads=True)
    s.pick, s.overlap, s.fraction = moved, True, fraction
    return s


def standing_for(serial: Trial, overlapped: Trial, per_rank: int) -> Trial:
    """`overlapped`'s record with the rate of the global step it stands for: the micro-steps before the last at
    `serial`'s time, then its one timed micro-step (the last, the host step running in its backward) and what is
    left of the host step. Its own rate would charge that host step to every micro-step, and the trials listed
    with the plan would show the overlap at half the rate the plan trains."""
    if overlapped.step_seconds <= 0:
        return overlapped
    # Summed here, not through `retimed`: what the overlapped last micro-step took beyond a serial one can be
    # negative (the host step wholly hidden, and the step measured faster), which no trial's optimizer seconds are.
    before = global_step_seconds(serial.step_seconds, 0.0, per_rank, overlapped.micro_batch_size) - serial.step_seconds
    seconds = before + overlapped.step_seconds + overlapped.optimizer_seconds
    return dataclasses.replace(overlapped, samples_per_second=per_rank / seconds)


def as_trained(run: Callable[[bool], Trial], overlap: bool, micro: int, per_rank: int) -> Trial:
    """A trial of one configuration whose rate is that of the global step training runs, from `run(overlap)`,
    which runs one. Overlapped offload hides the host step in the last micro-step's backward only: where the plan
    accumulates, a serial trial times the micro-steps before it (`standing_for`); an overlapped trial alone would
    charge the host step to every micro-step. Where the serial trial does not run clean, the overlapped one
    stands as it measured (its rate then low, never high)."""
    if not overlap:
        return run(False)
    last = run(True)
    if micro >= per_rank or not last.fits:
        return last
    serial = run(False)
    return standing_for(serial, last, per_rank) if serial.fits and serial.step_seconds > 0 else last


def may_hide_host_step(s: Ledger, precision: str) -> bool:
    """Whether the offload-overlap step may overlap a streamed host step with the last backward here: fit's
    search (the steps after the pick run) on one process, not over FSDP2 shards, the overlap not turned off,
    the optimizer streamed. A host-stepped engine's trials overlap already (its pipeline is on by default)."""
    after = s.after
    if after is None or s.world_size != 1 or after.sharded or not overlap_default():
        return False
    return streams(after.work.placement.kind, after.work.spec.cls_name, precision)


def hidden_host_step(optimizer_seconds: float, micro_step_seconds: float) -> float:
    """The once-a-step seconds left of a streamed host step overlapped with the last micro-step's backward: at
    best, all of that micro-step hides it (a bound: its backward is most of it)."""
    return max(0.0, optimizer_seconds - micro_step_seconds)


def overlapped_rate(trial: Trial, per_rank: int) -> float:
    """`trial`'s samples/s were its host step hidden as far as `hidden_host_step` allows: a bound."""
    return retimed(trial, hidden_host_step(trial.optimizer_seconds, trial.step_seconds), per_rank, 1).samples_per_second


def _over_host_budget(s: Ledger, trial: Trial, fraction: float) -> str:
    """Why `trial`'s configuration cannot overlap within the host budget (a second set of buffers), or ""."""
    work = s.afterwards().work
    need = host_budget.need(trial.rung, work.model, work.spec, work.placement.kind, fraction=fraction, overlap=True,
                            snapshot=work.snapshot_in_ram)
    if work.host_limit_bytes is None or need.total <= work.host_limit_bytes:
        return ""
    return (f"overlapped, the host would hold {format_bytes(need.total)}, over the host budget of "
            f"{format_bytes(work.host_limit_bytes)}")


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
