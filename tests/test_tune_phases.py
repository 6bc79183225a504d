"""Every second of a trial is in one of its phases, on the CPU under the simulated ceiling: real trials of a small
GPT, fitting and out of memory, with the phases adding up to the wall time a caller measures around the trial; and
`autotune plot` stacks them per trial."""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path

import pytest
import torch
from gpt import GPT, GPTConfig, random_batch

from autotune.configuration import Rung
from autotune.devices.placement import resolve_device
from autotune.evidence import TRIAL_PHASES, Evidence, Trial
from autotune.plan import Plan
from autotune.plotting import draw_search, search_figure
from autotune.search.trial import TrialRunner, Workload
from autotune.techniques import find_blocks
from autotune.workload.losses import resolve
from autotune.workload.optimizers import OptimizerSpec

CFG = GPTConfig(vocab_size=128, n_layer=4, n_embd=64, n_head=4, seq_len=64)


def _runner(budget: int, cfg: GPTConfig = CFG, per_rank: int = 8) -> TrialRunner:
    torch.manual_seed(0)
    model = GPT(cfg)
    work = Workload(model=model, batch=random_batch(cfg, per_rank), loss_fn=resolve(None),
                    spec=OptimizerSpec.from_user(None, model), placement=resolve_device("cpu"), budget_bytes=budget,
                    limit_bytes=int(0.9 * budget), per_rank=per_rank, blocks=find_blocks(model), measured_steps=2)
    return TrialRunner(work)


def _timed(runner: TrialRunner, rung: Rung, micro: int) -> tuple[Trial, float]:
    """The trial and the wall time around it. Python's automatic collections are held off meanwhile: one can land
    in the moments before the trial's first phase or after its last (an out-of-memory trial here takes 40 ms, and
    such a collection a few), which are the caller's time, not the trial's; the trial's own collection still runs."""
    gc.disable()
    try:
        started = time.perf_counter()
        trial = runner(rung, micro)
        return trial, time.perf_counter() - started
    finally:
        gc.enable()


def _adds_up(trial: Trial, wall: float) -> None:
    total = sum(trial.phases.values())
    assert abs(total - wall) <= 0.05 * wall, (trial.phases, wall)
    assert trial.seconds == pytest.approx(total)
    assert set(trial.phases) <= set(TRIAL_PHASES), trial.phases


@pytest.mark.parametrize("rung", [Rung(), Rung(checkpointing="full"), Rung(checkpointing="full", offload="optimizer")],
                         ids=lambda r: r.name)
def test_a_fitting_trials_phases_add_up_to_its_wall_time(rung: Rung) -> None:
    runner = _runner(2**40)
    trial, wall = _timed(runner, rung, 4)
    assert trial.fits, trial.note
    _adds_up(trial, wall)
    for phase in ("set-up", "warm-up", "measured", "restore", "clean-up"):
        assert trial.phases.get(phase, 0) > 0, (phase, trial.phases)
    # the measured steps take most of the step time the trial recorded: at least its median steps' worth
    assert trial.phases["measured"] >= 2 * (trial.step_seconds + trial.optimizer_seconds) * 0.9
    if rung.offload == "optimizer":  # the host optimizer's masters and moments: a phase of their own
        assert trial.phases["host buffers"] > 0, trial.phases


@pytest.mark.slow  # seconds: searches that run real trial steps
def test_an_out_of_memory_trials_phases_add_up_too() -> None:
    # A deeper, wider GPT than the others: its failing trial lasts about half a second, so that one preemption by a
    # busy neighbour (a few ms) stays well inside the 5%
    deeper = GPTConfig(vocab_size=128, n_layer=8, n_embd=128, n_head=4, seq_len=128)
    fitting = _runner(2**40, deeper, 16)(Rung(), 1)
    runner = _runner(fitting.peak_bytes, deeper, 16)  # micro-batch 1 fits, 16 times its activations do not
    trial, wall = _timed(runner, Rung(), 16)
    assert trial.outcome == "oom", trial
    _adds_up(trial, wall)
    assert "measured" not in trial.phases  # it never got there


def test_phases_round_trip_and_a_trial_recorded_before_them_still_loads() -> None:
    trial = Trial(rung=Rung(), micro_batch_size=2, outcome="ok", seconds=1.5,
                  phases={"set-up": 0.5, "measured": 1.0})
    assert Trial.from_dict(trial.to_dict()) == trial
    old = trial.to_dict()
    del old["phases"]
    assert Trial.from_dict(old).phases == {}
    evidence = Evidence(peak_memory_bytes=1, samples_per_second=1.0, trials=(trial,), tune_seconds=2.0,
                        tune_phases={"snapshot": 0.3, "other": 0.2})
    assert Evidence.from_dict(evidence.to_dict()) == evidence
    before = {k: v for k, v in evidence.to_dict().items() if k not in ("tune_seconds", "tune_phases", "untried")}
    assert Evidence.from_dict(before).tune_phases == {}
    with pytest.raises(ValueError, match=r"Trial.phases\['measured'\] must be a non-negative number"):
        Trial(rung=Rung(), micro_batch_size=2, outcome="ok", phases={"measured": -1.0})


def test_the_plot_stacks_each_trials_phases_in_the_order_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    runner = _runner(2**40)
    trials = (runner(Rung(), 2), runner(Rung(checkpointing="full", offload="optimizer"), 4))
    plan = Plan.of(precision="bf16", micro_batch_size=4, global_batch_size=8, memory_budget_bytes=2**30,
                   peak_memory_bytes=trials[1].peak_bytes, samples_per_second=trials[1].samples_per_second,
                   trials=trials, reason="tuned", tune_seconds=3.0, tune_phases={"loss check": 0.5, "other": 0.1})
    figure = search_figure(plan)
    assert len(figure.axes) == 3
    time_axis = figure.axes[2]
    shown = [text.get_text() for text in time_axis.get_legend().get_texts()]
    assert shown == [p for p in TRIAL_PHASES if any(t.phases.get(p) for t in trials)] and "host buffers" in shown
    tops = [max(bar.get_y() + bar.get_height() for c in time_axis.containers for bar in c if bar.get_x() < n + 0.5
                and bar.get_x() > n - 0.5) for n in (1, 2)]
    assert tops == pytest.approx([t.seconds for t in trials])  # each bar is the whole trial, stacked
    assert "in 3.0 s" in figure._suptitle.get_text()
    assert draw_search(plan, tmp_path / "search.png").stat().st_size > 0
    untimed = Plan.of(precision="bf16", micro_batch_size=4, global_batch_size=8, memory_budget_bytes=2**30,
                      peak_memory_bytes=1, samples_per_second=1.0, reason="by hand",
                      trials=tuple(dataclasses.replace(t, phases={}) for t in trials))
    assert len(search_figure(untimed).axes) == 2  # a plan from before phases: no third panel
