"""A run on the CPU reports two rates, autotune's (CPU time) and the script's (wall clock): each says which to trust."""

from __future__ import annotations

from cache_samples import sample

from autotune.supervisor import claims


def test_the_cpu_rate_says_it_is_the_one_to_compare_with_the_plan_and_the_wall_clock_the_one_for_duration() -> None:
    plan, _ = sample(0)
    assert plan.device == "cpu"
    run = claims.Measured(samples_per_second=5.0, steps=5, measured_steps=4, median_step_seconds=6.4)
    line = claims.describe(plan, run)
    assert "job's CPU time" in line and "trust these two to compare the plan with the run" in line, line
    assert "by the wall clock" in line and "the one that says how long training takes" in line, line
