"""The plan's reason says in words when the pick is slower than the runner-up: a tie-break for headroom."""

from __future__ import annotations

from autotune.configuration import Rung
from autotune.evidence import Trial
from autotune.search.choice import reason
from autotune.search.controller import Controller
from autotune.search.lines import best_so_far

MiB = 2**20
FULL = Rung(checkpointing="full", checkpointed_blocks=4)


def _search(rates: dict[Rung, float]) -> str:
    """The reason for the pick among two measured configurations at micro-batch 8 (plain: twice the peak)."""
    peaks = {Rung(): 120 * MiB, FULL: 60 * MiB}
    controller = Controller(lambda rung, micro: None, per_rank=8, limit_bytes=1024 * MiB)
    controller.trials.extend(Trial(rung=rung, micro_batch_size=8, outcome="ok", peak_bytes=peaks[rung],
                                   step_seconds=8 / rate, samples_per_second=rate) for rung, rate in rates.items())
    best = best_so_far(controller.ledger)
    assert best is not None
    return reason(controller.ledger, best)


def test_a_pick_slower_than_the_runner_up_is_explained_as_the_tie_break_for_headroom() -> None:
    reason = _search({Rung(): 100.0, FULL: 98.5})
    assert reason.startswith("bf16+full ckpt at micro-batch 8"), reason
    assert "0.98x the runner-up" not in reason, reason
    assert ("bf16 at micro-batch 8 measured 1.02x as fast, within the 3% timing noise, so the pick is the one with "
            "the lower peak (60.0 MiB against 120.0 MiB), for headroom") in reason, reason


def test_a_lead_under_the_noise_margin_is_called_a_tie() -> None:
    reason = _search({Rung(): 100.0, FULL: 120.0})
    assert reason.startswith("bf16+full ckpt at micro-batch 8"), reason
    assert "1.20x the fastest plan without" in reason and "timing noise" not in reason, reason
    close = _search({Rung(): 100.0, FULL: 102.0})
    assert close.endswith("1.02x the runner-up, bf16 at micro-batch 8, within the 3% timing noise"), close
