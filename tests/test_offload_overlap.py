"""fit's choice of whether the host optimizer steps during the last backward on one process
(search/offload_overlap.py), and the estimate that goes with it: exact on made-up figures. The trials that
measure them run for real in test_offload.py (the host optimizer) and test_offload_stream.py (streamed)."""

from __future__ import annotations

import pytest

from autotune.configuration import Rung
from autotune.evidence import Trial
from autotune.search import offload_overlap
from autotune.workload.batching import global_step_seconds

PER_RANK, MICRO = 65, 13  # five micro-batches, GPT-2 medium's one-GPU plan at 16 GiB
RUNG = Rung(offload="optimizer", compile=True)


def _serial(step_s: float = 0.13, optimizer_s: float = 0.09) -> Trial:
    per_step = global_step_seconds(step_s, optimizer_s, PER_RANK, MICRO)
    return Trial(rung=RUNG, micro_batch_size=MICRO, outcome="ok", peak_bytes=10, step_seconds=step_s,
                 optimizer_seconds=optimizer_s, samples_per_second=PER_RANK / per_step)


def _overlapped(step_s: float, optimizer_s: float, outcome: str = "ok") -> Trial:
    return Trial(rung=RUNG, micro_batch_size=MICRO, outcome=outcome, peak_bytes=11, step_seconds=step_s,
                 optimizer_seconds=optimizer_s)


def test_the_overlap_is_kept_when_faster_and_the_estimate_is_of_the_step_it_trains():
    serial = _serial()
    chosen, overlap, clause = offload_overlap.choose(serial, _overlapped(0.15, 0.02), PER_RANK, streamed=True)
    assert overlap is True
    assert clause == ("overlapped streamed optimizer offload: the last micro-batch and the optimizer took 0.170 s "
                      "overlapped, 0.220 s serial")
    # 50 ms saved once a global step: 5 x 0.13 + 0.04 instead of 5 x 0.13 + 0.09
    assert chosen.optimizer_seconds == pytest.approx(0.04)
    assert chosen.samples_per_second == pytest.approx(PER_RANK / 0.69)
    assert chosen.samples_per_second > serial.samples_per_second
    # the serial trial's configuration and peak stay (the overlapped trial's peak may be the allocator's layout)
    assert (chosen.rung, chosen.micro_batch_size, chosen.peak_bytes, chosen.step_seconds) == (RUNG, MICRO, 10, 0.13)


@pytest.mark.parametrize("step_s, optimizer_s", [(0.15, 0.07), (0.20, 0.02), (0.22, 0.0)])
def test_the_serial_step_stays_when_the_overlap_was_not_faster(step_s, optimizer_s):
    serial = _serial()
    chosen, overlap, clause = offload_overlap.choose(serial, _overlapped(step_s, optimizer_s), PER_RANK, streamed=False)
    assert overlap is False and chosen is serial
    assert clause.startswith("serial optimizer offload: the last micro-batch and the optimizer took ")


def test_an_overlapped_trial_over_the_limit_counts_only_when_streamed():
    serial = _serial()
    over = _overlapped(0.15, 0.02, outcome="over_budget")
    chosen, overlap, _ = offload_overlap.choose(serial, over, PER_RANK, streamed=True)
    assert overlap is True and chosen.peak_bytes == 10
    chosen, overlap, clause = offload_overlap.choose(serial, over, PER_RANK, streamed=False)
    assert overlap is False and chosen is serial
    assert clause == "serial optimizer offload: the overlapped trial: over_budget"
    chosen, overlap, clause = offload_overlap.choose(serial, _overlapped(0.0, 0.0, outcome="oom"), PER_RANK,
                                                     streamed=True)
    assert overlap is False and chosen is serial and clause.endswith("the overlapped trial: oom")
