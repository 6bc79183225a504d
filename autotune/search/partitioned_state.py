"""On replicated ranks: the pick with its optimizer state partitioned over the ranks, and the room that frees.

Replicated, every rank holds the FP32 weights, their FP32 gradients and the whole optimizer state: AdamW,
16 bytes a parameter. With `plan.offload_fraction` 0 under optimizer offload nothing goes to the host: the
weights and gradients are 16-bit, and each rank keeps the FP32 masters and state of its 1/world of the
parameters on the device, steps them, and sends the weights it updated to the others (ZeRO stage 1;
techniques/offload_partition.py): 4 + 12/world bytes a parameter, so on two ranks 6 fewer, 2.1 GB of GPT-2
medium. That room buys fewer recomputed blocks, or a larger micro-batch.

Measured on two H200s (GPT-2 medium, 16 GiB a GPU, 32 samples a rank; RESULTS.md tenth session): the
search's pick, compile with 16 of 24 blocks recomputed at 16 x 2, trained at 180,978 tok/s; partitioned at
the same blocks 181,525 (the partition costs nothing there); partitioned with 10 blocks recomputed 190,489
(1.05x); 8 blocks ran out of memory at 16 samples.

How the search reaches it, after the pick (no offload, several replicated ranks): one trial of the pick
partitioned measures the bytes it frees (the peaks of two measured trials, not arithmetic); the controller's
memory and time lines then predict the fastest configuration with that much more room
(`Controller.with_room`), which is run partitioned; after a miss, the next one the miss does not rule out.
Kept only when faster than the pick by more than noise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..plan import Rung, Trial
from ..techniques import offload_partition
from .controller import NOISE, Controller, SearchResult

TRIES = 2  # configurations tried with the freed room, after the trial that measures it

Run = Callable[[Rung, int], Trial]  # runs a rung at a micro-batch with the optimizer state partitioned


def eligible(best: Trial, world: int, sharded: bool, state_tensors: int, allowed: set[str] | frozenset[str]) -> bool:
    """Whether partitioning can free anything for the pick: several replicated ranks that partition (not
    FSDP2 shards, FP16 or $AUTOTUNE_OFFLOAD_PARTITION=0), an optimizer with state, optimizer offload allowed,
    and a pick without optimizer offload or 8-bit state."""
    return (world > 1 and not sharded and "offload" in allowed and state_tensors > 0 and offload_partition.wanted()
            and best.rung.precision != "fp16" and best.rung.offload == "none" and not best.rung.optimizer_8bit)


def partitioned(rung: Rung) -> Rung:
    """`rung` with optimizer offload: with an offload fraction of 0, the partitioned state."""
    return dataclasses.replace(rung, offload="optimizer")


def price(result: SearchResult, best: Trial, controller: Controller, run: Run, world: int) -> Trial | None:
    """The fastest partitioned trial if it beats `best` (the pick) by more than noise, else None. Adds the
    trials run to `result.trials`, and a note saying what was found either way."""
    first = run(partitioned(best.rung), best.micro_batch_size)
    ran = [first]
    winner = _faster(first, best)
    if first.fits and first.peak_bytes < best.peak_bytes:
        freed = best.peak_bytes - first.peak_bytes
        pool = [c for c in controller.with_room(best.rung, freed)
                if (c[0], c[1]) != (best.rung, best.micro_batch_size) and c[2] > best.samples_per_second * (1 + NOISE)]
        while pool and len(ran) <= TRIES:
            rung, micro, _ = pool.pop(0)
            trial = run(partitioned(rung), micro)
            ran.append(trial)
            if trial.fits:
                winner = max((t for t in (winner, _faster(trial, best)) if t is not None),
                             key=lambda t: t.samples_per_second, default=None)
                break
            pool = [c for c in pool if not _ruled_out(c, rung, micro)]
    result.trials.extend(ran)
    result.notes.append(_note(best, ran, winner, world))
    return winner


def _faster(trial: Trial, best: Trial) -> Trial | None:
    return trial if trial.fits and trial.samples_per_second > best.samples_per_second * (1 + NOISE) else None


def _ruled_out(candidate: tuple[Rung, int, float], missed: Rung, micro: int) -> bool:
    """A miss at `micro` with `missed`'s blocks says no fewer blocks fit at as many samples."""
    rung, m, _ = candidate
    return (rung.checkpointed_blocks or 0) <= (missed.checkpointed_blocks or 0) and m >= micro


def _note(best: Trial, ran: list[Trial], winner: Trial | None, world: int) -> str:
    tried = ", ".join(f"{t.rung.name} @ {t.micro_batch_size}: "
                      + (f"{t.samples_per_second:,.1f} samples/s" if t.fits else t.outcome) for t in ran)
    head = f"optimizer state partitioned over {world} ranks, none on the host ({tried})"
    if winner is None:
        return f"{head}: not faster than the pick"
    return f"{head}: kept"


def reason(winner: Trial, best: Trial, world: int, then: str) -> str:
    """The plan's reason when the partitioned configuration replaced the pick."""
    return (f"{winner.rung.name} at micro-batch {winner.micro_batch_size} with the optimizer state partitioned over "
            f"{world} ranks (16-bit weights and gradients; FP32 masters and state 1/{world} a rank, none on the host): "
            f"{winner.samples_per_second / best.samples_per_second:.2f}x {best.rung.name} at micro-batch "
            f"{best.micro_batch_size}, where every rank holds all of it; then: {then}")
