"""`fit(..., max_tune_seconds=...)` on the CPU under the simulated ceiling: the search stops starting trials once the
bound has passed, returns the best plan found within it plus one trial, says so, and its plan is cached marked;
and the progress line estimates the time left."""

from __future__ import annotations

import contextlib
import io
import re
import time
from pathlib import Path

import pytest
import torch
from gpt import GPT, GPTConfig, random_batch

import autotune
from autotune.configuration import Rung
from autotune.errors import InvalidSetting
from autotune.evidence import Trial
from autotune.search.progress import Progress

CFG = GPTConfig(vocab_size=128, n_layer=4, n_embd=32, n_head=4, seq_len=32)
# Between the peaks of micro-batch 1 and 2 without a technique: the search climbs through offload and checkpointing.
BUDGET = "1.5MiB"
CUT = r"search cut short at max_tune_seconds=\S+ .*after \d+ trial\(s\): \d+ configuration\(s\) it had lined up left"


def _fit(cache: object, **kw: object) -> tuple[autotune.Plan, float]:
    torch.manual_seed(0)
    model = GPT(CFG)
    started = time.perf_counter()
    plan = autotune.fit(model, random_batch(CFG, 8), global_batch_size=16, device="cpu", memory_budget=BUDGET,
                        cache=cache, trial_steps=1, techniques=("bf16", "checkpointing", "offload"), **kw)
    return plan, time.perf_counter() - started


@pytest.mark.slow  # seconds: an unbounded tune, then bounded ones that wait for their bound to pass
def test_a_bound_that_passes_mid_search_returns_within_it_plus_one_trial_and_says_so() -> None:
    _fit(False, max_tune_seconds=1e-6)  # warm (one trial): a process's first fit pays imports and first kernels
    full, full_wall = _fit(False)
    assert full.evidence.untried is None and "cut short" not in full.reason
    # A quarter of the whole tune: the search is mid-climb when it passes. On a loaded machine a noisy first
    # reading can let the bounded search rule the rest out and finish inside the bound; a smaller bound then
    # catches it mid-climb.
    for share in (4, 8, 16):
        bound = full_wall / share
        plan, wall = _fit(False, max_tune_seconds=bound)
        if plan.evidence.untried:  # cut short with configurations still planned
            break
        if plan.evidence.untried is None:  # (0: the bound passed during the last trial the search planned)
            assert wall <= 1.5 * bound, (wall, bound, "a search not cut short must have ended inside its bound")
    assert plan.evidence.untried is not None and plan.evidence.untried > 0, plan.reason
    assert len(plan.trials) < len(full.trials)
    # Within the bound plus the trial running when it passed, with room for a loaded machine's slower steps.
    assert wall <= 1.5 * bound + 2 * max(t.seconds for t in plan.trials), (wall, bound, plan.trials)
    assert plan.source == "tuned" and plan.trials[-1].seconds > 0
    assert re.search(CUT, plan.reason), plan.reason


def test_a_bound_that_passes_before_anything_fits_runs_to_the_first_fit() -> None:
    plan, _ = _fit(False, max_tune_seconds=1e-6)
    fits = [t.fits for t in plan.trials]
    assert fits[-1] and not any(fits[:-1]), plan.trials  # the search stopped at its first fitting trial
    assert "passed before any configuration fitted: the search went on to the first that did" in plan.reason
    assert "search cut short" in plan.reason


def test_a_cut_short_plan_is_cached_marked_and_served_only_to_a_bounded_fit(tmp_path: Path) -> None:
    cache = tmp_path / "plans.db"
    trials = 3  # in every fit alike: which plan the cache serves is under test here, not the search
    cut, _ = _fit(str(cache), max_tune_seconds=1e-6, max_trials=trials)
    assert cut.source == "tuned" and cut.evidence.untried is not None
    again, _ = _fit(str(cache), max_tune_seconds=1e-6, max_trials=trials)
    assert again.source == "cache" and again.evidence.untried == cut.evidence.untried
    full, _ = _fit(str(cache), max_trials=trials)  # unbounded: the cut-short plan is not what it asked for, so it tunes
    assert full.source == "tuned" and full.evidence.untried is None
    served, _ = _fit(str(cache), max_trials=trials)
    assert served.source == "cache" and served.evidence.untried is None


def test_the_bound_comes_from_the_environment_and_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTUNE_MAX_TUNE_SECONDS", "1e-6")
    plan, _ = _fit(False)
    assert plan.evidence.untried is not None, plan.reason
    with pytest.raises(InvalidSetting, match="max_tune_seconds must be a positive number of seconds"):
        _fit(False, max_tune_seconds=0)


def _trial(seconds: float) -> Trial:
    return Trial(rung=Rung(), micro_batch_size=2, outcome="ok", seconds=seconds, samples_per_second=1.0)


def test_the_progress_line_estimates_the_time_left_from_the_trials_planned() -> None:
    out = io.StringIO()
    progress = Progress(out, live=False, direct=True)
    progress.planned = lambda: 4
    progress.end(_trial(8.0))
    progress.end(_trial(12.0))
    assert "~40 s left (estimate, 4 more trial(s))" in out.getvalue().splitlines()[-1]  # mean 10 s x 4
    progress.planned = lambda: 0
    progress.end(_trial(10.0))
    assert out.getvalue().splitlines()[-1].endswith("nearly done)")


def test_a_tune_s_progress_says_the_time_left_and_where_the_time_went() -> None:
    out = io.StringIO()
    with contextlib.redirect_stderr(out):
        _fit(False, progress=True, max_trials=3)  # after each of the first two, more are planned
    lines = out.getvalue().splitlines()
    assert any("left (estimate" in line for line in lines), lines
    assert lines[-1].startswith("autotune: tuned in ") and "outside trials" in lines[-1], lines[-1]
