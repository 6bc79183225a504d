"""fit's choice of when replicated ranks all-reduce their gradients (search/reduce_timing.py): the decision from a
trial that timed the all-reduced step both ways, exact on made-up figures. The trial that measures them runs on
real gloo ranks in test_distributed_trial.py, the plan's step with one bucket in test_distributed_step.py."""

from __future__ import annotations

import pytest

from autotune.configuration import Rung
from autotune.evidence import Trial
from autotune.search import reduce_timing
from autotune.workload.batching import global_step_seconds

PER_RANK, WORLD, MICRO = 32, 2, 16  # two micro-batches a rank


def _pick(optimizer_s: float = 0.05, reduce_s: float = 0.02) -> Trial:
    per_step = global_step_seconds(0.2, optimizer_s, PER_RANK, MICRO)
    return Trial(rung=Rung(compile=True), micro_batch_size=MICRO, outcome="ok", peak_bytes=10, step_seconds=0.2,
                 optimizer_seconds=optimizer_s, reduce_seconds=reduce_s, samples_per_second=PER_RANK * WORLD / per_step)


def _timed(bucketed_s: float, after_s: float, outcome: str = "ok") -> Trial:
    return Trial(rung=Rung(compile=True), micro_batch_size=MICRO, outcome=outcome, step_seconds=0.2,
                 reduce_seconds=bucketed_s, reduce_after_seconds=after_s)


def test_one_bucket_after_backward_is_kept_when_it_measured_faster_and_the_estimate_moves_with_it():
    pick = _pick()
    chosen, overlap, clause = reduce_timing.choose(pick, _timed(0.030, 0.010), PER_RANK, WORLD)
    assert overlap is False
    assert clause.startswith("gradient all-reduce in one bucket after backward: an all-reduced micro-step took "
                             "0.2100 s with one after backward, 0.2300 s in buckets")
    # 20 ms saved once a global step: 2 x 0.2 + 0.03 instead of 2 x 0.2 + 0.05
    assert chosen.optimizer_seconds == pytest.approx(0.03) and chosen.reduce_seconds == pytest.approx(0.0)
    assert chosen.samples_per_second == pytest.approx(PER_RANK * WORLD / 0.43)
    assert chosen.samples_per_second > pick.samples_per_second
    assert (chosen.rung, chosen.micro_batch_size, chosen.peak_bytes) == (pick.rung, pick.micro_batch_size, 10)


@pytest.mark.parametrize("bucketed_s, after_s", [(0.010, 0.030), (0.010, 0.010), (0.010, 0.0085)])
def test_the_buckets_stay_unless_one_after_backward_is_faster_by_more_than_the_tie(bucketed_s, after_s):
    # 0.2085 against 0.2100: 0.7% shorter, under TIE (1%) of the all-reduced micro-step
    pick = _pick()
    chosen, overlap, clause = reduce_timing.choose(pick, _timed(bucketed_s, after_s), PER_RANK, WORLD)
    assert (chosen, overlap) == (pick, True)
    assert clause.startswith("gradient all-reduce in buckets during backward: an all-reduced micro-step took")


def test_just_past_the_tie_one_bucket_wins():
    pick = _pick()
    # (0.2 + 0.0) against (0.2 + 0.0030): 1.5% shorter
    assert reduce_timing.choose(pick, _timed(0.0030, 0.0), PER_RANK, WORLD)[1] is False


def test_a_timing_trial_that_did_not_fit_keeps_the_buckets_and_says_why():
    pick = _pick()
    chosen, overlap, clause = reduce_timing.choose(pick, _timed(0.0, 0.0, outcome="oom"), PER_RANK, WORLD)
    assert (chosen, overlap) == (pick, True)
    assert clause == "gradient all-reduce in buckets during backward (the trial timing both ways: oom)"


def test_only_replicated_ranks_choose():
    assert reduce_timing.eligible(2, sharded=False)
    assert not reduce_timing.eligible(1, sharded=False)  # one process: nothing to all-reduce
    assert not reduce_timing.eligible(4, sharded=True)  # FSDP2 reduce-scatters inside its own backward
