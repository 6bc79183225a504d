"""On a GPU without a `memory_budget`, the budget is the free memory rounded down to whole GiB, so the plan cache's
key holds from one run to the next while free memory moves by a few MiB."""

from __future__ import annotations

import pytest
import torch

from autotune.devices.placement import default_budget, resolve_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_default_budget_is_whole_gib_of_the_free_memory_and_holds_while_free_memory_moves() -> None:
    placement = resolve_device("cuda")
    before, source = default_budget(placement)
    free, _ = torch.cuda.mem_get_info()
    assert before % (1 << 30) == 0 and free - (1 << 30) < before <= free + torch.cuda.memory_reserved()
    assert "rounded down to whole GiB" in source
    held = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")  # 8 MiB more in use, as another context takes
    try:
        after, _ = default_budget(placement)
    finally:
        del held
    assert after in (before, before - (1 << 30))  # the same, unless free memory sat within 8 MiB of a GiB line
