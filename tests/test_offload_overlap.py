"""fit's choice of whether the host optimizer steps during the last backward on one process
(search/offload_overlap.py), and the estimate that goes with it: exact on made-up figures. The trials that
measure them run for real in test_offload.py (the host optimizer) and test_offload_stream.py (streamed)."""

from __future__ import annotations

import pytest
from after_pick_samples import after_pick

from autotune.configuration import Rung
from autotune.evidence import Trial
from autotune.search import offload_overlap
from autotune.search.controller import Controller
from autotune.search.ledger import Compiled, Lattice, Ledger
from autotune.search.lines import rung_state
from autotune.search.placement import candidates_for
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


def test_an_overlapped_trial_is_recorded_at_the_rate_of_the_step_it_stands_for():
    # W1's figures: 8 micro-batches of 8; serially 0.1146 s each and 0.224 s of host step; overlapped, the last
    # micro-step took 0.2784 s with 0.0264 s of the host step left after it
    serial = Trial(rung=RUNG, micro_batch_size=8, outcome="ok", peak_bytes=10, step_seconds=0.1146,
                   optimizer_seconds=0.224, samples_per_second=64 / (8 * 0.1146 + 0.224))
    raw = Trial(rung=RUNG, micro_batch_size=8, outcome="ok", peak_bytes=11, step_seconds=0.2784,
                optimizer_seconds=0.0264, samples_per_second=64 / (8 * 0.2784 + 0.0264), overlapped=True)
    recorded = offload_overlap.standing_for(serial, raw, 64)
    assert recorded.samples_per_second == pytest.approx(64 / (7 * 0.1146 + 0.2784 + 0.0264))  # 57.8, not 28.4
    assert (recorded.step_seconds, recorded.optimizer_seconds, recorded.overlapped) == (0.2784, 0.0264, True)
    chosen, overlap, _ = offload_overlap.choose(serial, raw, 64, streamed=True)
    assert overlap and chosen.samples_per_second == pytest.approx(recorded.samples_per_second)
    # the host step wholly hidden and the last micro-step measured faster than a serial one (a loaded CPU): the
    # record stands for 7 serial micro-steps and that one
    hidden = Trial(rung=RUNG, micro_batch_size=8, outcome="ok", peak_bytes=11, step_seconds=0.1, optimizer_seconds=0.0)
    assert offload_overlap.standing_for(serial, hidden, 64).samples_per_second == pytest.approx(64 / (7 * 0.1146 + 0.1))


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


# -- an offload rival measured overlapped, where the pick offloads nothing ---------------------------------------
MiB = 2**20
PLAIN, OFFLOAD = Rung(precision="bf16"), Rung(precision="bf16", offload="optimizer")


class Streamed:
    """One GPU, scripted: without offload the optimizer state holds 12 MiB and a micro-batch of 4 fits; offloaded,
    16 fit, but the streamed host step takes `host_s` serially and `overlapped_s` behind the last backward."""

    def __init__(self, host_s: float = 0.5, overlapped_s: float = 0.05) -> None:
        self.host_s, self.overlapped_s, self.calls = host_s, overlapped_s, []

    def __call__(self, rung: Rung, micro: int, **options: object) -> Trial:
        self.calls.append((rung, micro, options))
        offloaded = rung.offload == "optimizer"
        peak = int(((2 if offloaded else 14) + micro * 1.0) * MiB)
        step = 0.1 + 0.01 * micro
        opt = (self.overlapped_s if options.get("overlap") else self.host_s) if offloaded else 0.02
        return Trial(rung=rung, micro_batch_size=micro, outcome="ok" if peak <= 18 * MiB else "over_budget",
                     peak_bytes=peak, step_seconds=step, optimizer_seconds=opt,
                     samples_per_second=16 / global_step_seconds(step, opt, 16, micro))


def _picked(runner: Streamed, host_limit: int | None = None) -> Ledger:
    after = after_pick(runner, per_rank=16, limit_bytes=18 * MiB, host_limit=host_limit, allowed={"bf16", "offload"})
    return Controller(runner, per_rank=16, limit_bytes=18 * MiB).search([PLAIN, OFFLOAD], after=after)


@pytest.fixture
def streamed_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU test device streams the host step as a GPU does."""
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_STREAM", "1")
    monkeypatch.delenv("AUTOTUNE_OFFLOAD_OVERLAP", raising=False)


def test_an_offload_rival_that_lost_by_its_serial_host_step_is_measured_overlapped_and_wins(streamed_here) -> None:
    runner = Streamed()
    s = _picked(runner)
    overlapped = [(r, m) for r, m, o in runner.calls if o.get("overlap")]
    assert len(overlapped) == 1 and overlapped[0][0] == OFFLOAD, runner.calls
    micro = overlapped[0][1]
    assert s.pick.rung == OFFLOAD and s.pick.micro_batch_size == micro and s.overlap is True
    # serially the rival lost (0.5 s a step on the host); overlapped, 0.05 s: its estimate is of that step
    assert s.pick.optimizer_seconds == pytest.approx(0.05)
    steps = -(-16 // micro)
    assert s.pick.samples_per_second == pytest.approx(16 / (steps * (0.1 + 0.01 * micro) + 0.05))
    serial_best = max((t for t in s.trials if t.rung == PLAIN and t.fits), key=lambda t: t.samples_per_second)
    assert s.pick.samples_per_second > serial_best.samples_per_second * 1.03
    found = [f for f in s.findings if f.kind == "offload overlap"]
    assert len(found) == 1 and found[0].place == "leads", s.findings  # it replaced the pick


def test_a_rival_the_overlap_cannot_lift_past_the_pick_is_not_measured(streamed_here) -> None:
    runner = Streamed(host_s=2.0)  # even all of a micro-step hidden, 1.7 s of host step a step remain
    s = _picked(runner)
    assert not any(o.get("overlap") for _, _, o in runner.calls), runner.calls
    assert s.pick.rung == PLAIN and s.overlap is None


def test_a_rival_measured_overlapped_but_not_faster_leaves_the_pick(streamed_here) -> None:
    runner = Streamed(overlapped_s=0.45)  # the overlap hides little
    s = _picked(runner)
    assert [m for r, m, o in runner.calls if o.get("overlap")], runner.calls
    assert s.pick.rung == PLAIN and s.overlap is None
    assert any("measured overlapped" in n and "not faster than the pick" in n for n in s.notes), s.notes


def test_a_rival_whose_overlap_would_pass_the_host_budget_is_not_measured(streamed_here) -> None:
    runner = Streamed()
    s = _picked(runner, host_limit=1)  # one byte: no second set of host buffers fits
    assert not any(o.get("overlap") for _, _, o in runner.calls), runner.calls
    assert s.pick.rung == PLAIN
    assert any("not measured overlapped" in n and "over the host budget" in n for n in s.notes), s.notes


# -- the placement's price of a streamed host step ---------------------------------------------------------------
GiB = 2**30
# GPT-2 large at 24 GiB on an H100 (global batch 64, 36 blocks), the trials before compile with blocks recomputed is
# placed: (checkpointed blocks, offload, compile, micro-batch, peak GiB, micro-step s, optimizer s)
W1_TRIALS = [(0, "none", False, 1, 18.40, 0.0854, 0.0292), (0, "optimizer", False, 3, 16.51, 0.1154, 0.3064),
             (0, "optimizer", False, 4, 20.50, 0.1354, 0.2854), (0, "optimizer", True, 4, 11.26, 0.0783, 0.2736),
             (0, "optimizer", True, 10, 20.42, 0.1676, 0.2905), (0, "none", True, 4, 21.42, 0.0878, 0.0280),
             (36, "none", False, 4, 15.82, 0.1879, 0.0283), (36, "none", False, 8, 17.13, 0.3337, 0.0283),
             (36, "none", False, 16, 19.91, 0.6298, 0.0296), (36, "optimizer", False, 32, 13.34, 1.2185, 0.2834),
             (36, "none", True, 16, 17.17, 0.3282, 0.0282)]


def _w1_ledger(after: bool) -> Ledger:
    s = Ledger(runner=None, per_rank=64, limit=int(21.6 * GiB), cap=64, max_trials=24)
    s.lattice = Lattice(blocks=36, compile=True)
    for k, offload, compiled, micro, peak, step, opt in W1_TRIALS:
        rung = Rung(precision="bf16", checkpointing="full" if k else "none", checkpointed_blocks=k, offload=offload,
                    compile=compiled)
        trial = Trial(rung=rung, micro_batch_size=micro, outcome="ok", peak_bytes=int(peak * GiB), step_seconds=step,
                      optimizer_seconds=opt, samples_per_second=64 / global_step_seconds(step, opt, 64, micro))
        rung_state(s, rung).trials.append(trial)
        s.trials.append(trial)
    if after:
        s.after = after_pick(lambda *a, **k: None, per_rank=64, limit_bytes=s.limit, allowed={"bf16", "offload"})
    return s


def test_compiled_blocks_with_a_streamed_offload_are_priced_with_the_host_step_the_overlap_hides(
        streamed_here, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = Compiled(memory=1.0, time=0.3282 / (0.03982 + 0.03686 * 16))  # compiled full recompute / eager's line
    best = 64 / global_step_seconds(0.3282, 0.0282, 64, 16)  # every block recomputed and compiled, 47.7 samples/s

    def top(after: bool) -> tuple[Rung, int, float]:
        blocks = [c for c in candidates_for(_w1_ledger(after), "optimizer", compiled) if c[0].checkpointed_blocks]
        return max(blocks, key=lambda c: c[2])

    serial, hidden = top(after=False), top(after=True)  # without the steps after the pick, nothing may overlap
    # Charged its whole 0.27 s host step, the best block count with the optimizer offloaded loses; priced as the
    # overlap may hide it behind the last micro-step, it is worth a trial, at as many samples as fit either way.
    assert serial[2] < best < best * 1.03 < hidden[2], (serial, hidden, best)
    assert 0 < hidden[0].checkpointed_blocks < 36 and hidden[0].compile and hidden[1] > 10
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_OVERLAP", "0")  # the overlap turned off: the host step is paid whole
    assert top(after=True) == serial
