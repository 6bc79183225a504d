"""The plan's rate at the example's own length stands for the global step training runs. Under overlapped optimizer
offload only the last micro-step's backward hides the host step; the micro-steps before it run serially. Real
trials of a tiny GPT on the CPU, seen through the progress hook `typical.measure` takes."""

from __future__ import annotations

from typing import Any

import pytest
from gpt import GPTConfig, random_batch
from test_trial_reuse import OFFLOAD
from test_trial_reuse import _runner as reuse_runner

from autotune.evidence import Trial
from autotune.search import typical
from autotune.search.ledger import Ledger
from autotune.techniques.offload import host_buffers

CFG = GPTConfig(vocab_size=128, n_layer=2, n_embd=32, n_head=4, seq_len=16)
PER_RANK = 8


def _measured(micro: int) -> tuple[typical.TypicalRate | None, str, list[tuple[bool, Trial]]]:
    """`typical.measure` of an overlapped optimizer-offload pick at `micro`, on a batch half the trials' length:
    its rate, its note, and each trial it ran with whether that trial's measured steps overlapped the host step."""
    runner = reuse_runner(CFG)
    short = random_batch(GPTConfig(**{**CFG.__dict__, "seq_len": CFG.seq_len // 2}), PER_RANK)
    seen: list[tuple[bool, Trial]] = []

    def watch(run: Any, what: str) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Trial:
            trial = run(*args, **kwargs)
            seen.append((bool(kwargs.get("overlap")), trial))
            return trial
        return recorded

    with host_buffers.reusing():
        state = Ledger(runner=runner, per_rank=PER_RANK, limit=2**39, cap=PER_RANK, max_trials=4)
        state.pick, state.overlap = runner(OFFLOAD, micro, overlap=True), True
        rate, note = typical.measure(state, runner.work, short, watch)
    return rate, note, seen


def test_an_accumulating_overlapped_plan_charges_the_host_step_once_a_global_step() -> None:
    rate, note, seen = _measured(micro=2)
    assert rate is not None, note
    assert sorted(overlap for overlap, _ in seen) == [False, True], seen  # a serial trial beside the overlapped one
    serial = next(t for overlap, t in seen if not overlap)
    last = next(t for overlap, t in seen if overlap)
    assert serial.fits and last.fits and serial.step_seconds > 0 and last.step_seconds > 0
    steps = PER_RANK // 2
    # three serial micro-steps, then the last with the host step in its backward, then what is left of that step
    seconds = (steps - 1) * serial.step_seconds + last.step_seconds + last.optimizer_seconds
    assert rate.samples_per_second == pytest.approx(PER_RANK / seconds, rel=1e-9)
    assert rate.samples_per_second != pytest.approx(last.samples_per_second, rel=1e-6)  # not the host step 4 times


def test_a_plan_of_one_micro_step_is_measured_overlapped_alone() -> None:
    rate, note, seen = _measured(micro=PER_RANK)
    assert rate is not None, note
    assert [overlap for overlap, _ in seen] == [True], seen
    assert rate.samples_per_second == pytest.approx(seen[0][1].samples_per_second, rel=1e-9)
