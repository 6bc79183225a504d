"""Step after the pick, on replicated ranks: the partitioned optimizer state. Decides whether the pick with its
optimizer state sharded over the ranks, or the configuration the room that frees lets fit, replaces it
(`partitioned`).

Replicated, every rank holds the FP32 weights, their FP32 gradients and the whole optimizer state: AdamW,
16 bytes a parameter. A plan with `sharding="optimizer_state"` keeps 16-bit weights and gradients, and each
rank keeps the FP32 masters and state of its 1/world of the parameters on the device, steps them, and sends
the weights it updated to the others (ZeRO stage 1; the offload engine with nothing on the host,
techniques/offload/partition.py): 4 + 12/world bytes a parameter, so on two ranks 6 fewer. That room buys
fewer recomputed blocks, or a larger micro-batch.

How the search reaches it, after the pick (no offload, several replicated ranks): one trial of the pick
partitioned measures the bytes it frees (the peaks of two measured trials, not arithmetic); the search's
memory and time lines then predict the fastest configuration with that much more room
(`placement.with_room`), which is run partitioned; after a miss, the next one the miss does not rule out.
Kept only when faster than the pick, measured again as long, by more than noise (`price`). The trials, the
engine and the plan all name it `sharding="optimizer_state"` (with `offload="none"`).
"""

from __future__ import annotations

from collections.abc import Callable

from ..configuration import Rung
from ..evidence import Trial
from ..techniques.offload import partition as offload_partition
from ..workload.optimizers import state_tensors_per_parameter
from .ledger import Ledger
from .lines import NOISE
from .placement import ruled_out, with_room

TRIES = 2  # configurations tried with the freed room, after the trial that measures it
LONGER = 4  # times the search's measured steps, for every trial here (see `price`)

# run(rung, micro, sharding): a trial of LONGER times the search's measured steps, with the optimizer state
# partitioned over the ranks where `sharding` is "optimizer_state"
Run = Callable[[Rung, int, str], Trial]
PARTITIONED = "optimizer_state"  # the plan's name for it


def partitioned(s: Ledger) -> Ledger:
    """Step: on replicated ranks, the pick with the optimizer state partitioned over them (nothing on the host)
    and the configuration the room that frees lets fit, where that measured faster by more than noise
    (`price`); else the pick as it was."""
    best, ctx = s.picked(), s.afterwards()
    work, world = ctx.work, ctx.work.world_size
    if not eligible(best, world, ctx.sharded, state_tensors_per_parameter(work.spec), ctx.allowed):
        return s

    def run(rung: Rung, micro: int, sharding: str) -> Trial:
        return ctx.run(rung, micro, sharding=sharding, measured_steps=LONGER * work.measured_steps)

    winner, judged = price(s, best, run, world)
    if winner is None:
        return s
    then = "; then: "
    clause = reason(winner, judged, world, "")
    s.found("partitioned state", clause[:-len(then)] if clause.endswith(then) else clause, leads=True)
    s.pick = winner  # its `sharding`, the plan's
    return s


def eligible(best: Trial, world: int, sharded: bool, state_tensors: int, allowed: set[str] | frozenset[str]) -> bool:
    """Whether partitioning can free anything for the pick: several replicated ranks that partition (not
    FSDP2 shards, FP16 or $AUTOTUNE_OFFLOAD_PARTITION=0), an optimizer with state, optimizer offload allowed,
    and a pick without optimizer offload or 8-bit state."""
    return (world > 1 and "offload" in allowed and state_tensors > 0 and best.rung.offload == "none"
            and not best.rung.optimizer_8bit and offload_partition.partitions(best.rung.precision, sharded))


def price(s: Ledger, best: Trial, run: Run, world: int) -> tuple[Trial | None, Trial]:
    """(the partitioned trial to plan from, or None; the pick's trial it was judged against). Adds the trials
    run to `s.trials` once they are all run (the room is predicted from the search's own), and a note saying
    what was found either way.

    Every trial here runs LONGER times the search's measured steps, the pick's configuration again too, and the
    decision rests on those: a partitioned step's optimizer and all-reduce times settle only over more steps
    than the search measures, and the pick's own rate drifts between measurements, so short readings can rank
    the partitioned configurations below a pick they beat in training. The all-reduced step is read LONGER
    times here too (search/trial.py)."""
    first = run(best.rung, best.micro_batch_size, PARTITIONED)
    ran = [first]
    if first.fits and first.peak_bytes < best.peak_bytes:
        freed = best.peak_bytes - first.peak_bytes
        pool = [c for c in with_room(s, best.rung, freed)
                if (c[0], c[1]) != (best.rung, best.micro_batch_size) and c[2] > best.samples_per_second * (1 + NOISE)]
        while pool and len(ran) <= TRIES:
            rung, micro, _ = pool.pop(0)
            trial = run(rung, micro, PARTITIONED)
            ran.append(trial)
            if trial.fits:
                break
            pool = [c for c in pool if not ruled_out(c, rung, micro)]
    leader = max((t for t in ran if t.fits), key=lambda t: t.samples_per_second, default=None)
    judged = best
    if leader is not None:
        judged = run(best.rung, best.micro_batch_size, "none")
        ran.append(judged)
    faster = leader is not None and judged.fits and leader.samples_per_second > judged.samples_per_second * (1 + NOISE)
    winner = leader if faster else None
    s.trials.extend(ran)
    s.notes.append(_note(ran, winner, world))
    return winner, judged


def _note(ran: list[Trial], winner: Trial | None, world: int) -> str:
    tried = ", ".join(f"{t.rung.name} @ {t.micro_batch_size}: "
                      + (f"{t.samples_per_second:,.1f} samples/s" if t.fits else t.outcome) for t in ran)
    head = f"optimizer state partitioned over {world} ranks, none on the host ({tried})"
    if winner is None:
        return f"{head}: not faster than the pick"
    return f"{head}: kept"


def reason(winner: Trial, best: Trial, world: int, then: str) -> str:
    """The plan's reason when the partitioned configuration replaced the pick (`best`: as it was judged)."""
    return (f"{winner.rung.name} at micro-batch {winner.micro_batch_size} with the optimizer state partitioned over "
            f"{world} ranks (16-bit weights and gradients; FP32 masters and state 1/{world} a rank, none on the host): "
            f"{winner.samples_per_second / best.samples_per_second:.2f}x {best.rung.name} at micro-batch "
            f"{best.micro_batch_size}, where every rank holds all of it; then: {then}")
