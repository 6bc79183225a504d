"""A budget given as a small plain number is a unit left out, refused with the fix, never a budget of bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotune
from autotune.sizes import parse_bytes


@pytest.mark.parametrize("setting", ["memory_budget", "host_memory_budget"])
@pytest.mark.parametrize("value", [40, 40.0, 96, 2048])
def test_a_small_plain_number_budget_is_refused_with_a_unit_suggested(setting: str, value: float) -> None:
    with pytest.raises(autotune.InvalidSetting, match=rf"{setting}={value!r} .*did you mean '{value:g}GiB'"):
        autotune.fit(nn.Linear(4, 4), torch.randn(2, 4), device="cpu", cache=False, **{setting: value})


def test_bytes_as_an_integer_stay_bytes_from_64_kib() -> None:
    assert parse_bytes(200_000) == 200_000 and parse_bytes(24 * 2**30) == 24 * 2**30
    with pytest.raises(autotune.InvalidSetting, match=r"--budget=65535 .*at least 65536"):
        parse_bytes(65535, "--budget")
