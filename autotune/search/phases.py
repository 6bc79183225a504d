"""The phases after the controller's pick, in order, each refining one `SearchState` and recording what it found:
the host share of an offloaded optimizer, the optimizer state partitioned over replicated ranks, whether the
host optimizer overlaps the last backward, and when the gradient all-reduce runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..configuration import Rung
from ..evidence import Trial
from ..sizes import format_bytes, format_share
from ..techniques.offload import norm_parameters, overlap_default
from ..techniques.offload import partition as offload_partition
from ..techniques.offload.streamed import streams
from ..workload.optimizers import state_tensors_per_parameter
from . import host_budget, offload_overlap, partitioned_state, reduce_timing
from .controller import NOISE, Controller
from .deadline import OutOfTime
from .offload_share import choose_offload_fraction, offload_rival
from .state import SearchState
from .trial import Workload


@dataclass(kw_only=True)
class PhaseContext:
    """What every phase may use: the trial runner (`TrialRunner`'s call), the controller with its measured
    lines, the workload, whether the model is FSDP2-sharded, and the techniques allowed."""

    runner: Callable[..., Trial]
    controller: Controller
    work: Workload
    sharded: bool
    allowed: frozenset[str]
    host_shares: dict[Rung, float] = field(default_factory=dict)  # rungs whose whole optimizer the host cannot hold


Phase = Callable[[SearchState, PhaseContext], None]


def offload_share(state: SearchState, ctx: PhaseContext) -> None:
    """Under optimizer offload, the smallest host share that fits the chosen micro-batch (not over FSDP2:
    sharded ranks hold a share of each parameter already).

    Replicated ranks choose it too, alike: every rank runs the same share trials, whose outcomes the ranks
    agree on (`TrialRunner`'s `agree`), and the arithmetic is the same on each; left at the whole model, the
    ranks would stream all of the optimizer state every step.

    When the search picked a configuration without optimizer offload, its fastest offload rival is priced
    at a share too (`offload_rival`) and replaces the pick only if it is faster by more than noise."""
    best, work = state.best, ctx.work
    if ctx.sharded:
        return
    candidate = best if best.rung.offload == "optimizer" else offload_rival(state.trials, best, work.per_rank, NOISE)
    if candidate is None:
        return
    if candidate.rung in ctx.host_shares:  # the host holds all it can already: its trials ran at that share
        if candidate is best:
            state.fraction = ctx.host_shares[candidate.rung]
        return
    trainable = [p for p in work.model.parameters() if p.requires_grad]
    params = [trainable[i] for i in work.spec.held()]  # what the host optimizer splits: the parameters it trains
    chosen, fraction, ran, notes = choose_offload_fraction(
        candidate, lambda f: ctx.runner(candidate.rung, candidate.micro_batch_size, offload_fraction=f), params,
        work.limit_bytes, state_tensors_per_parameter(work.spec), norm_parameters(work.model),
        ranks=offload_partition.ranks(candidate.rung.precision, ctx.sharded))
    state.trials.extend(ran)
    if candidate is not best:
        rival_or_pick(state, chosen if chosen is not candidate else None, fraction)
        return
    state.notes.extend(notes)
    if chosen is not best:
        state.found("offload share", notes[0])
    state.best, state.fraction = chosen, fraction


def rival_or_pick(state: SearchState, shared: Trial | None, fraction: float) -> None:
    """The search's pick, or the offload rival at its share where that measured faster by more than noise."""
    best = state.best
    if shared is None or shared.samples_per_second <= best.samples_per_second * (1 + NOISE):
        what = (f"{shared.samples_per_second:,.1f} samples/s with {format_share(fraction)} of the parameters' "
                "optimizer on the host" if shared is not None else "no share on the device fitted")
        state.notes.append(f"optimizer offload priced at a partial share: {what}, not faster than the pick")
        return
    state.found("offload share", f"{shared.rung.name} at micro-batch {shared.micro_batch_size} with "
                f"{format_share(fraction)} of the parameters' optimizer on the host: "
                f"{shared.samples_per_second / best.samples_per_second:.2f}x {best.rung.name} at micro-batch "
                f"{best.micro_batch_size}, the pick with the whole optimizer offloaded or none", leads=True)
    state.best, state.fraction = shared, fraction


def partitioned(state: SearchState, ctx: PhaseContext) -> None:
    """On replicated ranks, the pick with the optimizer state partitioned over them (nothing on the host) and
    the configuration the room that frees lets fit, where that measured faster by more than noise
    (search/partitioned_state.py); else the pick as it was."""
    work, world = ctx.work, ctx.work.world_size
    if not partitioned_state.eligible(state.best, world, ctx.sharded, state_tensors_per_parameter(work.spec),
                                      ctx.allowed):
        return

    def run(rung: Rung, micro: int, sharding: str) -> Trial:
        return ctx.runner(rung, micro, sharding=sharding, measured_steps=partitioned_state.LONGER * work.measured_steps)

    winner, judged = partitioned_state.price(state, state.best, ctx.controller, run, world)
    if winner is None:
        return
    then = "; then: "
    clause = partitioned_state.reason(winner, judged, world, "")
    state.found("partitioned state", clause[:-len(then)] if clause.endswith(then) else clause, leads=True)
    state.best = winner  # its `sharding`, the plan's


def overlap(state: SearchState, ctx: PhaseContext) -> None:
    """Under optimizer offload on one process, whether the host steps during the last backward: one trial
    of the chosen configuration with its measured steps overlapped (search/offload_overlap.py). Leaves
    `state.overlap` None where it is not a choice (no host optimizer, several ranks, FSDP2 shards, the
    overlap turned off)."""
    best, work, fraction = state.best, ctx.work, state.fraction or 1.0
    if best.rung.offload != "optimizer" or work.world_size != 1 or ctx.sharded or not overlap_default():
        return
    need = host_budget.need(best.rung, work.model, work.spec, work.placement.kind, fraction=fraction, overlap=True,
                            snapshot=work.snapshot_in_ram)
    if work.host_limit_bytes is not None and need.total > work.host_limit_bytes:
        state.found("offload overlap", f"serial optimizer offload: overlapped, the host would hold "
                    f"{format_bytes(need.total)}, over the host budget of {format_bytes(work.host_limit_bytes)}")
        state.overlap = False
        return
    other = ctx.runner(best.rung, best.micro_batch_size, offload_fraction=fraction, overlap=True)
    state.trials.append(other)
    streamed = streams(work.placement.kind, work.spec.cls_name, best.rung.precision)
    state.best, state.overlap, clause = offload_overlap.choose(best, other, work.per_rank, streamed)
    state.found("offload overlap", clause)


def reduce(state: SearchState, ctx: PhaseContext) -> None:
    """On replicated ranks, whether the gradient all-reduce runs in buckets during the last backward or in one
    after it: one trial of the pick timing both (search/reduce_timing.py). Leaves `state.reduce_overlap` None
    where autotune all-reduces nothing (one rank, FSDP2 shards)."""
    best, work = state.best, ctx.work
    if not reduce_timing.eligible(work.world_size, ctx.sharded):
        return
    shared = best.rung.offload == "optimizer" and state.fraction is not None
    timed = ctx.runner(best.rung, best.micro_batch_size, reduce_pairs=reduce_timing.PAIRS,
                       offload_fraction=state.fraction if shared else 1.0, sharding=best.sharding)
    state.trials.append(timed)
    state.best, state.reduce_overlap, clause = reduce_timing.choose(best, timed, work.per_rank, work.world_size)
    state.found("reduce timing", clause)


PHASES: tuple[Phase, ...] = (offload_share, partitioned, overlap, reduce)


def run_phases(state: SearchState, ctx: PhaseContext, phases: tuple[Phase, ...] = PHASES) -> SearchState:
    """Run `phases` in order over `state`; each refines the pick and records what it found. Once max_tune_seconds
    has passed (a trial refused with `OutOfTime`), the phase in progress keeps what it had and the rest are skipped."""
    for phase in phases:
        try:
            phase(state, ctx)
        except OutOfTime:
            state.cut = True
            break
    return state


__all__ = ["PHASES", "Phase", "PhaseContext", "offload_share", "overlap", "partitioned", "reduce", "rival_or_pick",
           "run_phases"]
