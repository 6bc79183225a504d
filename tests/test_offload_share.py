"""Choosing the host share of optimizer offload against a scripted device (search/offload_share.py).

The device is a formula, as in test_controller.py: the peak grows by `cost` bytes for each element kept on the
device, the step gets faster the less is on the host. The arithmetic charges 18 bytes an element (AdamW); a
device whose real cost is a fifth of that leaves room the first share does not use, and one more trial
takes it; a device whose cost matches the arithmetic gets no second trial.
"""

from __future__ import annotations

from torch import nn

from autotune.configuration import Rung
from autotune.evidence import Trial
from autotune.search.offload_share import choose_offload_fraction
from autotune.techniques.offload import host_share

RUNG = Rung(offload="optimizer")
BASE = 1 << 30  # the peak with every parameter on the host


def params() -> list[nn.Parameter]:
    return [p for layer in [nn.Linear(256, 256) for _ in range(8)] for p in layer.parameters()]


class Device:
    def __init__(self, cost: float, limit: int) -> None:
        self.cost, self.limit, self.tried = cost, limit, []

    def kept(self, fraction: float) -> int:
        ps = params()
        host = set(host_share([p.numel() for p in ps], fraction))
        return sum(p.numel() for i, p in enumerate(ps) if i not in host)

    def __call__(self, fraction: float) -> Trial:
        self.tried.append(fraction)
        peak = int(BASE + self.cost * self.kept(fraction))
        rate = 100.0 / (1.0 + fraction)  # less on the host, a shorter optimizer tail
        return Trial(rung=RUNG, micro_batch_size=4, outcome="ok" if peak <= self.limit else "over_budget",
                     peak_bytes=peak, step_seconds=0.1, optimizer_seconds=fraction, samples_per_second=rate)


def full_offload() -> Trial:
    return Trial(rung=RUNG, micro_batch_size=4, outcome="ok", peak_bytes=BASE, step_seconds=0.1,
                 optimizer_seconds=1.0, samples_per_second=50.0)


def choose(device: Device):
    return choose_offload_fraction(full_offload(), device, params(), device.limit, state_tensors=2)


LIMIT = BASE + 4 * 2**20  # room for ~200 k elements at the arithmetic's 18 bytes each (of 526 k)


def test_a_share_that_used_far_less_memory_than_predicted_earns_a_smaller_one():
    device = Device(cost=18 / 5, limit=LIMIT)
    chosen, fraction, ran, notes = choose(device)
    first, second = device.tried
    assert second < first - 0.05 and fraction == second and chosen is ran[1]
    assert chosen.fits and chosen.peak_bytes <= LIMIT
    assert "was tried and kept" in notes[0], notes


def test_a_share_whose_memory_matched_the_arithmetic_is_kept_without_another_trial():
    device = Device(cost=18, limit=LIMIT)
    chosen, fraction, ran, notes = choose(device)
    assert len(device.tried) == 1 and fraction == device.tried[0] and chosen.fits
    assert 0 < fraction < 1 and "tried" not in notes[0]


class Crowded(Device):
    """Its second trial finds the memory taken after all (a neighbour, fragmentation): over the limit."""

    def __call__(self, fraction: float) -> Trial:
        trial = super().__call__(fraction)
        if len(self.tried) == 2:
            return Trial(rung=RUNG, micro_batch_size=4, outcome="over_budget", peak_bytes=self.limit + 1,
                         step_seconds=0.1, optimizer_seconds=fraction, samples_per_second=trial.samples_per_second)
        return trial


def test_a_refined_share_over_the_limit_leaves_the_first():
    device = Crowded(cost=18 / 5, limit=LIMIT)
    chosen, fraction, ran, notes = choose(device)
    assert len(ran) == 2 and fraction == device.tried[0] and chosen is ran[0]
    assert "over_budget" in notes[0], notes


def test_partitioned_ranks_are_charged_their_dearest_run_not_an_even_split():
    # GPT-2's token embedding leads its parameters and one rank holds it whole: the share must fit that rank,
    # not half the share (two H200s: a 15% device share grew the peak by 1.4 GiB where half was charged).
    import torch

    from autotune.search.offload_share import bytes_to_device, predict_fraction
    from autotune.techniques.offload.partition import runs

    ps = [nn.Parameter(torch.zeros(300_000))] + params()  # an "embedding" of 300 k, then 526 k in 16 tensors
    numels = [p.numel() for p in ps]
    costs = [bytes_to_device(p, 2, keep_fp32=False) for p in ps]

    def dearest(kept: int) -> int:
        return max(sum(costs[i] for i in run) for run in runs(range(kept), numels, 2))

    room = int(1.3 * costs[0])
    fraction = predict_fraction(ps, room, state_tensors=2, ranks=2)
    kept = len(ps) - len(host_share(numels, fraction))
    assert 2 <= kept < len(ps) - 1
    assert dearest(kept) <= room < dearest(kept + 1)  # the most the dearest rank can hold
    assert sum(costs[:kept + 1]) / 2 <= room  # where an even split would have kept more
