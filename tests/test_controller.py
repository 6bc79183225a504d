"""The decision graph against a scripted fake runner (no model, no device): what it tries and what it picks."""

from __future__ import annotations

import pytest

from autotune.configuration import Rung
from autotune.errors import NoFeasiblePlan
from autotune.evidence import Trial
from autotune.search.controller import Controller
from autotune.search.lines import best_so_far
from autotune.workload.batching import global_step_seconds, split_sizes

GiB = 2**30
BF16, SEL, FULL = Rung(), Rung(checkpointing="selective"), Rung(checkpointing="full")
OFFLOAD = Rung(checkpointing="full", offload="optimizer")


class FakeGPU:
    """peak(m) = fixed + m x per_sample per rung; step time = launch + m x per_sample_time x recompute."""

    def __init__(self, budget, per_rank, rungs):
        self.budget, self.per_rank, self.rungs, self.calls = budget, per_rank, rungs, []

    def __call__(self, rung, micro):
        self.calls.append((rung, micro))
        fixed, per_sample, launch, sample_time, *rest = self.rungs[rung]
        opt = rest[0] if rest else 0.01
        peak = int(fixed + micro * per_sample)
        if peak > self.budget:
            return Trial(rung=rung, micro_batch_size=micro, outcome="oom", peak_bytes=self.budget)
        step = launch + micro * sample_time
        rate = self.per_rank / global_step_seconds(step, opt, self.per_rank, micro)
        outcome = "ok" if peak <= 0.9 * self.budget else "over_budget"
        return Trial(rung=rung, micro_batch_size=micro, outcome=outcome, peak_bytes=peak, step_seconds=step,
                     optimizer_seconds=opt, samples_per_second=rate)


def _search(gpu, rungs, **kw):
    return Controller(gpu, per_rank=gpu.per_rank, limit_bytes=int(0.9 * gpu.budget), **kw).search(rungs)


def test_checkpointing_wins_when_it_lets_a_launch_bound_model_grow():
    # PEERS.md's GPT-2 large shape: without checkpointing only micro-batch 2 fits; with it, 8 does, faster.
    gpu = FakeGPU(24 * GiB, 64, {
        BF16: (14 * GiB, 3.0 * GiB, 0.10, 0.030),
        SEL: (14 * GiB, 1.8 * GiB, 0.12, 0.034),
        FULL: (14 * GiB, 0.8 * GiB, 0.14, 0.040),
        OFFLOAD: (4 * GiB, 0.8 * GiB, 0.14, 0.040, 1.5),  # the CPU optimizer step is slow
    })
    result = _search(gpu, [BF16, SEL, FULL, OFFLOAD])
    assert result.picked().rung == FULL
    assert result.picked().micro_batch_size == 8  # balanced: 8 x 8 covers 64 like 9 would not do better
    assert len(result.trials) <= 12
    assert sum(t.outcome == "oom" for t in result.trials) == 0
    assert "x the fastest plan without checkpointing" in result.head


def test_no_climbing_when_the_cheapest_rung_already_runs_the_whole_batch():
    gpu = FakeGPU(80 * GiB, 16, {BF16: (1 * GiB, 0.5 * GiB, 0.01, 0.01), FULL: (1 * GiB, 0.1 * GiB, 0.01, 0.013)})
    result = _search(gpu, [BF16, FULL])
    assert result.picked().rung == BF16 and result.picked().micro_batch_size == 16
    assert all(rung == BF16 for rung, _ in gpu.calls)


def test_a_saturated_rung_stops_the_climb():
    # GPU-bound (no launch overhead): bigger micro-batches buy nothing, recompute only costs.
    gpu = FakeGPU(24 * GiB, 64, {BF16: (4 * GiB, 1 * GiB, 0.0, 0.03), FULL: (4 * GiB, 0.3 * GiB, 0.0, 0.04)})
    result = _search(gpu, [BF16, FULL])
    assert result.picked().rung == BF16
    assert any("skipped bf16+full ckpt" in n for n in result.notes)
    assert all(rung == BF16 for rung, _ in gpu.calls)


def test_prediction_is_verified_and_bisected_after_a_miss():
    class Convex(FakeGPU):  # memory grows faster than linearly: the line over-predicts
        def __call__(self, rung, micro):
            self.rungs[rung] = (2 * GiB, (0.5 + 0.05 * micro) * GiB, 0.0, 0.01)
            return super().__call__(rung, micro)

    gpu = Convex(16 * GiB, 64, {BF16: None})
    result = _search(gpu, [BF16])
    sizes = [m for _, m in gpu.calls]
    assert sizes[:2] == [1, 2] and len(sizes) <= 6
    best = result.picked().micro_batch_size
    assert 2 + best * (0.5 + 0.05 * best) <= 0.9 * 16  # the winner really fits under the limit


def test_nothing_fits_raises_with_what_was_tried():
    gpu = FakeGPU(8 * GiB, 8, {BF16: (9 * GiB, 1 * GiB, 0, 0.01), FULL: (8.5 * GiB, 0.1 * GiB, 0, 0.01)})
    with pytest.raises(NoFeasiblePlan,
                       match=r"even at micro-batch 1 on the top rung \(bf16\+full ckpt\).*Tried: bf16 @ 1: oom") as err:
        _search(gpu, [BF16, FULL])
    assert len(err.value.trials) == 2


def test_headroom_breaks_a_tie():
    gpu = FakeGPU(24 * GiB, 8, {BF16: (1 * GiB, 2 * GiB, 0.0, 0.01)})
    controller = Controller(gpu, per_rank=8, limit_bytes=int(0.9 * gpu.budget))
    a = Trial(rung=BF16, micro_batch_size=8, outcome="ok", peak_bytes=20 * GiB, samples_per_second=100.0)
    b = Trial(rung=FULL, micro_batch_size=8, outcome="ok", peak_bytes=10 * GiB, samples_per_second=98.5)
    c = Trial(rung=SEL, micro_batch_size=8, outcome="ok", peak_bytes=5 * GiB, samples_per_second=90.0)
    controller.trials[:] = [a, b, c]
    assert best_so_far(controller.ledger) is b  # within 3% of the fastest, and more headroom; c is too slow


def test_max_micro_caps_the_search():
    gpu = FakeGPU(80 * GiB, 64, {BF16: (1 * GiB, 0.1 * GiB, 0.01, 0.01)})
    result = _search(gpu, [BF16], max_micro=5)
    assert result.picked().micro_batch_size <= 5
    assert max(m for _, m in gpu.calls) <= 5


# ResNet-152, 224x224, global batch 256, 12 GiB ceiling on an H100 (W3 of benchmarks/, the grid of the run in
# benchmarks/data/peers.jsonl): micro-batch -> (peak GiB, forward+backward s, optimizer s), and the first OOM.
W3_H100 = {
    BF16: ({1: (1.88, .0752, .0152), 2: (2.06, .0742, .0147), 4: (2.23, .0518, .0095), 8: (2.58, .0678, .0141),
            16: (3.26, .0622, .0133), 32: (4.74, .0572, .0130), 64: (7.62, .0708, .0156)}, 128),
    SEL: ({1: (2.00, .1235, .0149), 2: (2.04, .1269, .0150), 4: (2.16, .1362, .0164), 8: (2.46, .1354, .0142),
           16: (3.04, .1154, .0140), 32: (4.24, .1244, .0152), 64: (6.63, .1286, .0155), 128: (11.87, .1550, .0166)},
          256),
    FULL: ({1: (1.99, .1521, .0166), 2: (2.02, .1607, .0152), 4: (2.13, .1873, .0169), 8: (2.38, .1668, .0177),
            16: (2.84, .1564, .0150), 32: (3.75, .1965, .0161), 64: (5.70, .1836, .0152), 128: (10.06, .2154, .0172)},
           256),
    OFFLOAD: ({1: (1.26, .1768, .0918), 2: (1.28, .1897, .1299), 4: (1.31, .1741, .0558), 8: (1.53, .1715, .0860),
               16: (2.05, .1565, .0603), 32: (3.14, .1665, .0589), 64: (5.26, .1650, .0488), 128: (9.73, .1601, .0764)},
              256),
}


class MeasuredGPU:
    """Real measurements, interpolated linearly between measured micro-batches and extrapolated from the
    last two; an OOM past the budget or at the first micro-batch the grid saw run out of memory."""

    def __init__(self, budget, per_rank, table):
        self.budget, self.per_rank, self.table, self.calls = budget, per_rank, table, []

    def measure(self, rung, micro):
        points, first_oom = self.table[rung]
        xs = sorted(points)
        lo = max([x for x in xs if x <= micro] or xs[:1])
        hi = min([x for x in xs if x > lo] or [lo])
        if hi == lo:  # past the last point: the last two points' slopes
            lo, hi = xs[-2], xs[-1]
        f = (micro - lo) / (hi - lo)
        peak, step, opt = (a + f * (b - a) for a, b in zip(points[lo], points[hi]))
        return int(peak * GiB), max(step, 1e-4), opt, micro >= first_oom or peak * GiB > self.budget

    def rate(self, rung, micro):
        """The truth: every micro-step costs its own size's time, a short last one included."""
        opt = self.measure(rung, micro)[2]
        return self.per_rank / (sum(self.measure(rung, m)[1] for m in split_sizes(self.per_rank, micro)) + opt)

    def __call__(self, rung, micro):
        self.calls.append((rung, micro))
        peak, step, opt, oom = self.measure(rung, micro)
        if oom:
            return Trial(rung=rung, micro_batch_size=micro, outcome="oom", peak_bytes=self.budget)
        outcome = "ok" if peak <= 0.9 * self.budget else "over_budget"
        rate = self.per_rank / global_step_seconds(step, opt, self.per_rank, micro)  # as TrialRunner estimates
        return Trial(rung=rung, micro_batch_size=micro, outcome=outcome, peak_bytes=peak, step_seconds=step,
                     optimizer_seconds=opt, samples_per_second=rate)


def test_a_prediction_that_fits_with_room_to_spare_is_refined_upward():
    # Regression from the H100: micro-batch 1 and 2 predicted 43 on bf16, which peaked at 6.1 of 10.8 GiB; the
    # search stopped there, climbed, and chose optimizer offload at 128 (0.60x the grid's best in training).
    gpu = MeasuredGPU(12 * GiB, 256, W3_H100)
    result = _search(gpu, [BF16, SEL, FULL, OFFLOAD])
    best_possible = max(gpu.rate(rung, m) for rung in W3_H100 for m in range(1, 257)
                        if not gpu.measure(rung, m)[3] and gpu.measure(rung, m)[0] <= 0.9 * gpu.budget)
    assert result.picked().rung == BF16
    assert gpu.rate(BF16, result.picked().micro_batch_size) >= 0.97 * best_possible
    assert result.picked().micro_batch_size > 64  # past the grid's powers of two: 3 micro-steps instead of 4
    assert sum(t.outcome == "oom" for t in result.trials) <= 2  # a higher rung's growth probe may run out
    assert len(result.trials) <= 12


# GPT-2 large, seq 1024, global batch 64, 24 GiB ceiling on an H100 (W1 of benchmarks/, the grid in
# benchmarks/data/peers.jsonl line 6), in the same form as W3_H100.
ACT = Rung(checkpointing="full", offload="activations")
W1_H100 = {
    BF16: ({1: (19.08, .0563, .0270), 2: (23.23, .0778, .0272)}, 4),
    SEL: ({1: (17.44, .1248, .0273), 2: (20.11, .1086, .0271)}, 4),
    FULL: ({1: (16.84, .1396, .0284), 2: (17.31, .1320, .0271), 4: (18.53, .1763, .0274), 8: (22.73, .3257, .0276)},
           16),
    ACT: ({1: (16.82, .1323, .0273), 2: (17.25, .1584, .0285), 4: (18.53, .2079, .0278), 8: (21.63, .3808, .0295),
           16: (23.75, .7282, .0283)}, 32),
    OFFLOAD: ({1: (5.03, .1758, .3352), 2: (5.86, .1757, .2922), 4: (7.43, .1933, .2943), 8: (11.17, .3166, .2843),
               16: (17.19, .6087, .2787)}, 32),
}


def test_gpt2_large_on_an_h100_is_tuned_within_noise_of_the_best_without_an_oom():
    gpu = MeasuredGPU(24 * GiB, 64, W1_H100)
    result = Controller(gpu, per_rank=64, limit_bytes=int(0.9 * gpu.budget), remeasure=gpu).search(list(W1_H100))
    best_possible = max(gpu.rate(rung, m) for rung in W1_H100 for m in range(1, 65)
                        if not gpu.measure(rung, m)[3] and gpu.measure(rung, m)[0] <= 0.9 * gpu.budget)
    assert gpu.rate(result.picked().rung, result.picked().micro_batch_size) >= 0.97 * best_possible
    # 16 before trials that could not beat the best by more than noise were skipped; here 12 and a runoff of
    # 2, which the H100 run itself did not need (full checkpointing's 6 measured 12% behind, not within 8%).
    assert len(result.trials) <= 14
    assert sum(t.outcome == "oom" for t in result.trials) == 0
    # Optimizer offload borrows full checkpointing's bytes per sample: from 6 straight to the prediction.
    assert [m for rung, m in gpu.calls if rung == OFFLOAD] == [6, 16, 16]  # the last is the runoff
    # 6 peaked at 20.6 GiB and 8 at 22.7 against a 21.6 GiB limit: the line between them rules 7 out untried.
    assert (FULL, 6) in gpu.calls and (FULL, 8) in gpu.calls and (FULL, 7) not in gpu.calls
    # Activation offload: 6 fits, 8 runs over; 7 would fit, but its time line says it cannot beat full
    # checkpointing's best by more than noise, so it is not run.
    assert (ACT, 6) in gpu.calls and (ACT, 7) not in gpu.calls
    assert any("bf16+full ckpt+activations offload: skipped micro-batch 7" in n for n in result.notes)


def test_a_higher_rung_that_can_win_is_still_explored():
    # The same pair with a cheap copy (5% per micro-step): the larger micro-batches it allows win.
    gpu = FakeGPU(24 * GiB, 64, {
        FULL: (14 * GiB, 0.8 * GiB, 0.14, 0.040),
        ACT: (14 * GiB, 0.2 * GiB, 0.14 * 1.05, 0.040 * 1.05),
    })
    result = _search(gpu, [FULL, ACT])
    assert result.picked().rung == ACT and result.picked().micro_batch_size > 8


def test_a_cap_just_under_the_batch_leaves_no_larger_balanced_size_to_probe():
    """`autotune run` after an OOM at the whole batch retunes with the cap one below it: every micro-batch over half
    the batch then runs two micro-steps, like half the batch itself, so no balanced size lies above half. A higher
    rung that fits at half, where the rung below fitted, has nothing larger to probe: its exploration ends there
    (it raised StopIteration out of the search)."""
    from autotune.search.explore import balanced_probe, explore
    from autotune.search.ledger import Ledger
    from autotune.search.lines import rung_state

    gpu = FakeGPU(80 * GiB, 32, {BF16: (10 * GiB, 3.5 * GiB, 0.01, 0.01), FULL: (1 * GiB, 0.1 * GiB, 0.01, 0.011)})
    s = Ledger(runner=gpu, per_rank=32, limit=72 * GiB, cap=31, max_trials=24)
    below = rung_state(s, BF16)
    below.trials += [gpu(BF16, 16), gpu(BF16, 31)]  # the rung below: fits at 16, not at 31
    assert [t.fits for t in below.trials] == [True, False]
    explore(s, rung_state(s, FULL), below)
    assert gpu.calls[2:] == [(FULL, 16)]  # one trial, at 16; nothing above it
    assert balanced_probe(s, 8, 32) == 16  # below half, a larger balanced size is still probed
    s.sizes = [1, 2, 4, 8, 16]  # `autotune run`'s allowed sizes: none above 16 either
    assert balanced_probe(s, 16, 32) is None
