"""How ranks agree on a trial (`distributed.agree_trial`): the worst outcome wins, compile failures included.

A compile failure on one rank (Inductor can fail on one rank and not another: different caches, a race on the
shared cache directory) must make every rank leave compile; before "error" had a code, agreeing on such a trial
raised KeyError inside `fit` under torchrun. One rank in a real gloo group exercises the collective path.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from autotune import parallel as distributed
from autotune.configuration import Rung
from autotune.evidence import NOISY, Trial


def _trial(outcome: str, **figures) -> Trial:
    ran = outcome in ("ok", "over_budget")
    base = dict(rung=Rung(precision="bf16", compile=True), micro_batch_size=4, outcome=outcome,
                peak_bytes=2**30, seconds=3.0, step_seconds=0.5 if ran else 0.0,
                samples_per_second=8.0 if ran else 0.0, compile_seconds=9.0, note="")
    return Trial(**{**base, **figures})


def test_a_compile_failure_on_another_rank_is_a_compile_failure_on_every_rank():
    mine = _trial("ok")
    theirs = _trial("error", peak_bytes=2**29, compile_seconds=12.0, note="BackendCompilerFailed")
    agreed = [max(a, b) for a, b in zip(distributed.trial_figures(mine), distributed.trial_figures(theirs))]
    merged = distributed.merged_trial(mine, agreed)
    assert merged.outcome == "error" and merged.note == "an error on another rank"
    assert merged.samples_per_second == 0.0 and merged.step_seconds == 0.0  # no rate from a trial that failed
    assert merged.compile_seconds == 12.0 and merged.peak_bytes == 2**30  # the plan's figures match on every rank


def test_the_slowest_rank_and_the_fullest_gpu_make_the_agreed_trial():
    mine, theirs = _trial("ok"), _trial("over_budget", peak_bytes=3 * 2**30, step_seconds=0.8, samples_per_second=5.0)
    agreed = [max(a, b) for a, b in zip(distributed.trial_figures(mine), distributed.trial_figures(theirs))]
    merged = distributed.merged_trial(mine, agreed)
    assert (merged.outcome, merged.peak_bytes, merged.step_seconds, merged.samples_per_second) == \
        ("over_budget", 3 * 2**30, 0.8, 5.0)
    assert merged.note == "another rank's peak was over the limit"


def test_noisy_timings_on_one_rank_are_counted_on_every_rank():
    """The plan's reason counts noisy trials; counted per rank, the ranks' plans differed in their reason."""
    mine, theirs = _trial("ok"), _trial("ok", noisy=True, note=f"{NOISY} (step times spread 80% over 9 steps)")
    agreed = [max(a, b) for a, b in zip(distributed.trial_figures(mine), distributed.trial_figures(theirs))]
    merged = distributed.merged_trial(mine, agreed)
    assert merged.noisy and NOISY in merged.note
    assert (distributed.merged_trial(theirs, agreed).noisy
            and distributed.merged_trial(theirs, agreed).note == theirs.note)


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("outcome", ["ok", "over_budget", "oom", "error"])
def test_every_outcome_goes_through_the_collective(one_rank, outcome):
    trial = _trial(outcome)
    assert dataclasses.replace(distributed.agree_trial(trial), note="") == dataclasses.replace(trial, note="")
