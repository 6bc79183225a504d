"""The steps after the pick as more steps over the search's one `Ledger`, run by the controller's loop: against a
scripted runner on two replicated ranks (the all-reduce timing runs), with a trial refused for time where the
test says."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from after_pick_samples import after_pick

from autotune.configuration import Rung
from autotune.evidence import Trial
from autotune.search.controller import AFTER_PICK, AfterPick, Controller
from autotune.search.deadline import OutOfTime
from autotune.search.ledger import Ledger
from autotune.search.plan_reason import reason
from autotune.workload.batching import global_step_seconds

MiB = 2**20
PLAIN, FULL = Rung(), Rung(checkpointing="full", checkpointed_blocks=2)


class Ranks:
    """Two replicated ranks: peak = 10 MiB + m x 1 MiB (half with recompute), a micro-step 0.05 s + m x 0.01 s
    (1.3x with recompute); an all-reduce timed both ways reads one bucket after backward faster. Refuses every
    trial after `stop` of them, as max_tune_seconds does."""

    def __init__(self, stop: int | None = None) -> None:
        self.stop, self.calls = stop, []

    def __call__(self, rung: Rung, micro: int, **options: Any) -> Trial:
        if self.stop is not None and len(self.calls) >= self.stop:
            raise OutOfTime("max_tune_seconds passed")
        self.calls.append((rung, micro, options))
        ckpt = rung.checkpointing != "none"
        peak = int((10 + micro * (0.5 if ckpt else 1.0)) * MiB)
        step = (0.05 + 0.01 * micro) * (1.3 if ckpt else 1.0)
        trial = Trial(rung=rung, micro_batch_size=micro, outcome="ok" if peak <= 20 * MiB else "oom",
                      peak_bytes=peak, step_seconds=step, optimizer_seconds=0.02,
                      samples_per_second=16 / global_step_seconds(step, 0.02, 16, micro))
        if options.get("reduce_pairs"):
            trial = dataclasses.replace(trial, reduce_seconds=0.02, reduce_after_seconds=0.01)
        return trial


def _after(runner: Ranks) -> AfterPick:
    return after_pick(runner, per_rank=16, limit_bytes=20 * MiB, budget_bytes=22 * MiB, world_size=2,
                      allowed={"bf16", "checkpointing"})


def _search(runner: Ranks, after: bool = True) -> Ledger:
    controller = Controller(runner, per_rank=16, limit_bytes=20 * MiB, world_size=2)
    return controller.search([PLAIN, FULL], after=_after(runner) if after else None)


def test_the_steps_after_the_pick_refine_the_search_s_own_ledger() -> None:
    searched = _search(Ranks(), after=False)
    runner = Ranks()
    s = _search(runner)
    assert s.trials[:len(searched.trials)] == searched.trials and s.head == searched.head
    # the all-reduce timing ran last, on the pick, in the same record, and decided `reduce_overlap`
    (rung, micro, options), = [c for c in runner.calls if c[2]]
    assert (rung, micro, options["reduce_pairs"]) == (searched.picked().rung, searched.picked().micro_batch_size, 4)
    assert len(s.trials) == len(searched.trials) + 1 and s.reduce_overlap is False and not s.cut
    assert [f.kind for f in s.findings] == ["reduce timing"]
    assert reason(s, []).startswith(f"{searched.head}; gradient all-reduce in one bucket after backward")
    assert s.picked().samples_per_second > searched.picked().samples_per_second  # its rate estimated again


def test_a_trial_refused_for_time_after_the_pick_ends_those_steps_and_keeps_the_pick() -> None:
    searched = _search(Ranks(), after=False)
    s = _search(Ranks(stop=len(searched.trials)))  # the search runs whole, the all-reduce timing is refused
    assert s.cut and s.reduce_overlap is None and not s.findings
    assert s.picked() == searched.picked() and s.trials == searched.trials and s.head == searched.head


def test_without_an_after_pick_the_steps_after_the_pick_refuse_to_run() -> None:
    s = _search(Ranks(), after=False)
    for step in AFTER_PICK:
        with pytest.raises(RuntimeError, match="no AfterPick"):
            step(s)


def test_a_recheck_cut_short_picks_from_the_readings_it_replaced() -> None:
    # Recompute beats no recompute at the same micro-batch, by more than the added work can explain: the
    # recheck measures both again; the first re-measurement (recompute, slower now) replaces its reading, the
    # second is refused for time. The pick is the best of the readings then in the record: no recompute.
    rates = {PLAIN: 50.0, FULL: 80.0}

    def run(rung: Rung, micro: int) -> Trial:
        return Trial(rung=rung, micro_batch_size=micro, outcome="ok", peak_bytes=micro * MiB, step_seconds=0.1,
                     samples_per_second=rates[rung] * micro / 16)

    again: list[Rung] = []

    def remeasure(rung: Rung, micro: int) -> Trial:
        if again:
            raise OutOfTime("max_tune_seconds passed")
        again.append(rung)
        return dataclasses.replace(run(rung, micro), samples_per_second=40.0 * micro / 16)

    s = Controller(run, per_rank=16, limit_bytes=64 * MiB, remeasure=remeasure).search([PLAIN, FULL])
    assert again == [FULL] and s.cut
    assert s.picked().rung == PLAIN and s.head.startswith("bf16 at micro-batch 16"), s.head
