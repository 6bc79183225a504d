"""On replicated ranks: the pick with its optimizer state partitioned over the ranks, and the room that frees.

Replicated, every rank holds the FP32 weights, their FP32 gradients and the whole optimizer state: AdamW,
16 bytes a parameter. With `plan.offload_fraction` 0 under optimizer offload nothing goes to the host: the
weights and gradients are 16-bit, and each rank keeps the FP32 masters and state of its 1/world of the
parameters on the device, steps them, and sends the weights it updated to the others (ZeRO stage 1;
techniques/offload_partition.py): 4 + 12/world bytes a parameter, so on two ranks 6 fewer, 2.1 GB of GPT-2
medium. That room buys fewer recomputed blocks, or a larger micro-batch.

Measured on two H200s (GPT-2 medium, 16 GiB a GPU, 32 samples a rank; RESULTS.md tenth session): the pick,
compile with 16 of 24 blocks recomputed at 16 x 2, peaked at 14.09 GiB in its trial and 11.17-11.18 GiB
partitioned (2.9 GiB freed); the room predicted 10 blocks at 16 x 2, which peaked at 14.16 GiB. Trained in
one process after fit: 190,489 tok/s partitioned with 10 blocks against 180,978 for the pick (call 1, a host
share of 0.1% then); in call 2 fit chose it and trained 193,560, the pick after it 182,749.

How the search reaches it, after the pick (no offload, several replicated ranks): one trial of the pick
partitioned measures the bytes it frees (the peaks of two measured trials, not arithmetic); the controller's
memory and time lines then predict the fastest configuration with that much more room
(`Controller.with_room`), which is run partitioned; after a miss, the next one the miss does not rule out.
Kept only when faster than the pick, measured again as long, by more than noise (`price`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..configuration import Rung

from ..evidence import Trial
from ..techniques import offload_partition
from .controller import NOISE, Controller, SearchResult, _ruled_out

TRIES = 2  # configurations tried with the freed room, after the trial that measures it
LONGER = 4  # times the search's measured steps, for every trial here (see `price`)

# run(rung, micro): a trial of LONGER times the search's measured steps; of a rung with optimizer offload, with
# nothing on the host (the state partitioned)
Run = Callable[[Rung, int], Trial]


def eligible(best: Trial, world: int, sharded: bool, state_tensors: int, allowed: set[str] | frozenset[str]) -> bool:
    """Whether partitioning can free anything for the pick: several replicated ranks that partition (not
    FSDP2 shards, FP16 or $AUTOTUNE_OFFLOAD_PARTITION=0), an optimizer with state, optimizer offload allowed,
    and a pick without optimizer offload or 8-bit state."""
    return (world > 1 and "offload" in allowed and state_tensors > 0 and best.rung.offload == "none"
            and not best.rung.optimizer_8bit and offload_partition.partitions(best.rung.precision, sharded))


def partitioned(rung: Rung) -> Rung:
    """`rung` with optimizer offload: with an offload fraction of 0, the partitioned state."""
    return dataclasses.replace(rung, offload="optimizer")


def price(result: SearchResult, best: Trial, controller: Controller, run: Run, world: int) -> tuple[Trial | None, Trial]:
    """(the partitioned trial to plan from, or None; the pick's trial it was judged against). Adds the trials
    run to `result.trials`, and a note saying what was found either way.

    Every trial here runs LONGER times the search's measured steps, the pick's configuration again too, and the
    decision rests on those: with the search's 3 measured steps the partitioned step read slow (two H200s, 10
    blocks at 16 x 2: optimizer 45 ms and all-reduce 13 ms a step, 188,274 tok/s; with 12 steps 28 and 7 ms,
    197,413; trained 199,142), and the pick itself measured 164 to 187 samples/s between lends (RESULTS.md
    tenth session): short readings ranked the partitioned configurations below the pick they beat in training.
    The all-reduced step, read once in the search's trials, is read LONGER times here too (search/trial.py):
    read once, it still had the partitioned plan 5% slow in two calls of three (RESULTS.md twelfth session)."""
    first = run(partitioned(best.rung), best.micro_batch_size)
    ran = [first]
    if first.fits and first.peak_bytes < best.peak_bytes:
        freed = best.peak_bytes - first.peak_bytes
        pool = [c for c in controller.with_room(best.rung, freed)
                if (c[0], c[1]) != (best.rung, best.micro_batch_size) and c[2] > best.samples_per_second * (1 + NOISE)]
        while pool and len(ran) <= TRIES:
            rung, micro, _ = pool.pop(0)
            trial = run(partitioned(rung), micro)
            ran.append(trial)
            if trial.fits:
                break
            pool = [c for c in pool if not _ruled_out(c, rung, micro)]  # `rung` as the candidates are: no offload
    leader = max((t for t in ran if t.fits), key=lambda t: t.samples_per_second, default=None)
    judged = best
    if leader is not None:
        judged = run(best.rung, best.micro_batch_size)
        ran.append(judged)
    faster = leader is not None and judged.fits and leader.samples_per_second > judged.samples_per_second * (1 + NOISE)
    winner = leader if faster else None
    result.trials.extend(ran)
    result.notes.append(_note(ran, winner, world))
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
