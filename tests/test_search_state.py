"""The one search state, the `Ledger`, as the steps after the pick leave it, and the plan's reason composed once
from what they found."""

from typing import Any

from autotune.configuration import Rung
from autotune.evidence import Trial
from autotune.search.ledger import Ledger
from autotune.search.plan_reason import account, reason


def _trial(noisy: bool = False) -> Trial:
    return Trial(rung=Rung(), micro_batch_size=4, outcome="ok", step_seconds=0.1, samples_per_second=40.0,
                 noisy=noisy)


def _ledger(trials: list[Trial], **kw: Any) -> Ledger:
    def runner(rung: Rung, micro: int) -> Trial:
        raise AssertionError("no trial runs here")

    return Ledger(runner=runner, per_rank=4, limit=2**30, cap=4, max_trials=24, trials=trials, pick=_trial(), **kw)


def test_findings_wrap_the_pick_in_the_order_the_steps_after_it_found_them():
    state = _ledger([_trial()], head="pick")
    state.found("offload share", "share")
    state.found("partitioned state", "partitioned", leads=True)
    state.found("offload overlap", "overlap")
    assert account(state) == "partitioned; then: pick; share; overlap"


def test_the_reason_puts_the_floor_note_first_cuts_the_notes_and_keeps_the_last_clauses_and_the_noise():
    state = _ledger([_trial(noisy=True), _trial()], notes=["b"], head="pick", floor_note="micro-batch 1 skipped")
    text = reason(state, ["a", "micro-batch 1 skipped", "b", "c"], first="sharded", last=("loss",))
    assert text.startswith("sharded; pick; micro-batch 1 skipped; a; b; loss; timings were noisy in 1 of 2 trials")


def test_a_finding_also_among_the_notes_is_said_once():
    # The offload-share step records its note and finds the same clause: the reason says it once.
    state = _ledger([_trial()], head="pick")
    state.found("offload share", "optimizer offload of 40% of the parameters")
    text = reason(state, ["optimizer offload of 40% of the parameters", "other note"])
    assert text.count("optimizer offload of 40% of the parameters") == 1, text
    assert text.endswith("other note"), text
