"""Step after the pick, on replicated ranks: the all-reduce timing. Decides when the gradient all-reduce runs, in
buckets during the last backward or in one after it (`reduce`).

Replicated, `TrainingStep` sums the ranks' gradients itself (`distributed.OverlappedReduce`): by default in
buckets of 25 MiB started while the last micro-batch's backward goes on, as DDP does. That overlap does not
always pay: one bucket after backward can train a few percent faster (under the partitioned optimizer state,
with 16-bit gradients), tie, or lose by as much. Neither wins everywhere.

So `fit` times both on its last pick: one trial whose all-reduced step runs `PAIRS` times each way, in the
order ABBA... (a drift of the machine's speed falls on both alike), the figures agreed over ranks (MAX: every
rank decides alike, as it must: the ranks' buckets must match). One bucket after backward is kept when its
median step is shorter by more than `TIE`; either way `plan.reduce_overlap` says which was measured faster.
The threshold is small because the choice is cheap to get wrong: where the two tie, they train alike.
"""

from __future__ import annotations

from ..evidence import Trial
from .ledger import Ledger
from .trial import retimed

PAIRS = 4  # all-reduced steps timed each way: 8 micro-steps beside the trial's own
TIE = 0.01  # one bucket must shorten the all-reduced micro-step by more than this share to be kept


def reduce(s: Ledger) -> Ledger:
    """Step: whether the gradient all-reduce runs in buckets during the last backward or in one after it, by one
    trial of the pick timing both (`choose`). Leaves `s.reduce_overlap` None where autotune all-reduces
    nothing (one rank, FSDP2 shards)."""
    best, ctx = s.picked(), s.afterwards()
    work = ctx.work
    if not eligible(work.world_size, ctx.sharded):
        return s
    shared = best.rung.offload == "optimizer" and s.fraction is not None
    timed = ctx.run(best.rung, best.micro_batch_size, reduce_pairs=PAIRS,
                    offload_fraction=s.fraction if shared else 1.0, sharding=best.sharding)
    s.trials.append(timed)
    s.pick, s.reduce_overlap, clause = choose(best, timed, work.per_rank, work.world_size)
    s.found("reduce timing", clause)
    return s


def eligible(world: int, sharded: bool) -> bool:
    """Several replicated ranks: autotune all-reduces their gradients (FSDP2 reduces inside its own backward)."""
    return world > 1 and not sharded


def choose(best: Trial, timed: Trial, per_rank: int, world: int) -> tuple[Trial, bool, str]:
    """(the trial to plan from, `plan.reduce_overlap`, a clause for the plan's reason), from `timed`: a trial of
    `best`'s configuration that timed the all-reduced step both ways (`TrialRunner(..., reduce_pairs=PAIRS)`).

    Kept in buckets, `best` is as it was. After backward, `best` with the all-reduce's cost moved by what the
    timing trial measured between the two ways, and its rate estimated again from that."""
    if not timed.fits:
        return best, True, ("gradient all-reduce in buckets during backward "
                            f"(the trial timing both ways: {timed.outcome})")
    bucketed = timed.step_seconds + timed.reduce_seconds
    after = timed.step_seconds + timed.reduce_after_seconds
    measured = f"an all-reduced micro-step took {after:.4f} s with one after backward, {bucketed:.4f} s in buckets"
    if after >= bucketed * (1 - TIE):
        return best, True, f"gradient all-reduce in buckets during backward: {measured}"
    saved = timed.reduce_seconds - timed.reduce_after_seconds
    moved = retimed(best, max(0.0, best.optimizer_seconds - saved), per_rank, world,
                    reduce_seconds=max(0.0, best.reduce_seconds - saved))
    return moved, False, f"gradient all-reduce in one bucket after backward: {measured}"
