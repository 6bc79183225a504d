"""A step re-run after an out-of-memory attempt starts from the buffers the attempt started from, a buffer the
attempt reassigned (rather than updated in place) included."""

from __future__ import annotations

import pytest
import torch
from test_models_batchnorm import NormNet, padded, run
from test_step import make_plan

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest.py


class Reassigning(NormNet):
    """A running count kept as `self.seen = self.seen + n`: each training forward gives the module a new tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen = self.seen + x.shape[0]
        return super().forward(x)


def test_a_buffer_the_failed_attempt_reassigned_is_put_back():
    torch.manual_seed(0)
    model = Reassigning().double()
    batch = padded([8, 5, 8, 3, 64, 40, 64, 7])  # the second micro-batch of 4 runs out of memory at 4, not at 2
    short = padded([8, 5, 8, 3, 6, 4, 8, 7], seed=1)
    peak = {micro: run(make_plan(micro, 8), model, [batch])[1].last_peak_bytes for micro in (2, 4)}
    got, step = run(make_plan(4, 8, budget=(peak[2] + peak[4]) // 2), model, [short, batch])
    assert len(step.recoveries) == 1
    assert float(got.seen) == 16.0  # 8 samples a step, the failed attempt's 4 not counted
