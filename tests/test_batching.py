"""Pure arithmetic: accumulation, prediction, bisection."""

from __future__ import annotations

import pytest

from autotune.errors import InvalidSetting
from autotune.workload.batching import (
    bisect_next,
    fit_line,
    global_step_seconds,
    per_rank_batch,
    predict_max_micro_batch,
    solve_accumulation,
    split_sizes,
)


@pytest.mark.parametrize("per_rank,micro,expected", [(64, 8, (8, 8)), (64, 10, (7, 4)), (5, 8, (1, 5)), (7, 1, (7, 1))])
def test_accumulation_covers_the_batch_exactly(per_rank, micro, expected):
    steps, last = solve_accumulation(per_rank, micro)
    assert (steps, last) == expected
    assert sum(split_sizes(per_rank, micro)) == per_rank


def test_global_batch_must_divide_by_world_size_and_names_the_nearest_values():
    assert per_rank_batch(64, 4) == 16
    with pytest.raises(InvalidSetting, match=r"global_batch_size \(66\).*world size \(4\).*64 or 68"):
        per_rank_batch(66, 4)
    with pytest.raises(InvalidSetting, match="positive integer"):
        per_rank_batch(0, 1)


def test_prediction_from_the_memory_slope():
    # peak = 100 + 10 m; limit 250 -> 15
    assert predict_max_micro_batch([(1, 110), (2, 120)], 250, 64) == 15
    assert predict_max_micro_batch([(1, 110), (2, 120)], 250, 8) == 8  # capped
    assert predict_max_micro_batch([(1, 110), (2, 120)], 105, 64) == 1  # never below 1
    # a flat slope is noise: only double the largest measured size
    assert predict_max_micro_batch([(4, 100), (8, 100)], 1000, 64) == 16


def test_line_fit_and_bisection():
    assert fit_line([(1, 3), (3, 7)]) == pytest.approx((1, 2))
    assert bisect_next(4, 8) == 6
    assert bisect_next(4, 5) is None


def test_global_step_time_charges_a_short_last_micro_batch_as_a_full_one():
    # 64 at micro 10: six full micro-steps, one of 4 samples, one optimizer step
    assert global_step_seconds(1.0, 0.5, 64, 10) == pytest.approx(7 + 0.5)  # the short last one costs a full one
