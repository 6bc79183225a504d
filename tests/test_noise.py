"""Timings on a busy machine: noisy trials measure longer and say so, and a recompute win that recompute
cannot explain is measured again instead of believed."""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch import nn

import autotune
from autotune.configuration import Rung
from autotune.evidence import Trial
from autotune.search.controller import Controller
from autotune.search.ledger import Ledger
from autotune.search.plan_reason import reason
from autotune.search.trial import NOISY_SPREAD, spread

PLAIN, FULL = Rung(precision="fp32"), Rung(precision="fp32", checkpointing="full")
MiB = 2**20


def test_spread_is_relative_to_the_median_whole_step() -> None:
    assert spread([(0.010, 0.001)] * 3) == 0.0
    assert spread([(0.010, 0.0), (0.011, 0.0), (0.030, 0.0)]) > NOISY_SPREAD  # one step lost its core
    assert spread([(0.010, 0.0), (0.0105, 0.0), (0.011, 0.0)]) < NOISY_SPREAD


class ContendedCPU:
    """A fixed 50 ms a step plus 10 ms a sample (12.5 with recompute); 1 MiB a sample (0.5 with recompute).
    The first measurements without recompute at `contended` micro-batches ran while another process held
    the cores: 5x slower."""

    def __init__(self, contended: set[int]) -> None:
        self.contended = contended
        self.calls: list[tuple[Rung, int, bool]] = []

    def run(self, rung: Rung, micro: int, *, again: bool = False) -> Trial:
        self.calls.append((rung, micro, again))
        ckpt = rung.checkpointing != "none"
        seconds = 0.05 + 0.01 * micro * (1.25 if ckpt else 1.0)
        if not ckpt and micro in self.contended and not again:
            seconds *= 5
        # A configuration's first trial compiles (as on a GPU: seconds of a cold tune), a reading again does not
        phases = {"measured": 4 * seconds} if again else {"compile": 2.0, "measured": 4 * seconds}
        return Trial(rung=rung, micro_batch_size=micro, outcome="ok", step_seconds=seconds, optimizer_seconds=0.0,
                     samples_per_second=micro / seconds, peak_bytes=int(micro * MiB * (0.5 if ckpt else 1.0)),
                     seconds=sum(phases.values()), phases=phases)


def search(cpu: ContendedCPU) -> Ledger:
    controller = Controller(cpu.run, per_rank=8, limit_bytes=int(4.5 * MiB),
                            remeasure=lambda rung, micro: cpu.run(rung, micro, again=True))
    return controller.search([PLAIN, FULL])


def test_a_recompute_win_recompute_cannot_explain_is_remeasured_and_not_believed() -> None:
    cpu = ContendedCPU(contended={1, 2, 4})
    result = search(cpu)
    # Checkpointing at micro-batch 4 "beat" no checkpointing at micro-batch 4: both measured again.
    assert [(r.checkpointing, m) for r, m, again in cpu.calls if again] == [("full", 4), ("none", 4)], cpu.calls
    assert any("more than recompute can explain: both re-measured" in n for n in result.notes), result.notes
    plain4 = next(t for t in result.trials if t.rung == PLAIN and t.micro_batch_size == 4)
    assert plain4.samples_per_second == 4 / 0.09 and "re-measured; first 8.9 samples/s" in plain4.note
    # In the first reading's place, with its time: the tune's account keeps the compile the first reading did
    assert plain4.phases == pytest.approx({"compile": 2.0, "measured": 4 * (0.09 * 5 + 0.09)}), plain4.phases
    assert plain4.seconds == pytest.approx(sum(plain4.phases.values()))
    # The re-measurements took the first figures' places: one line per configuration in the record.
    assert len(result.trials) == len({(t.rung, t.micro_batch_size) for t in result.trials})
    # Micro-batch 8 (only checkpointing fits it) amortises the fixed cost: the true winner, by the model.
    assert (result.picked().rung, result.picked().micro_batch_size) == (FULL, 8)


def test_without_a_contradiction_nothing_is_remeasured() -> None:
    cpu = ContendedCPU(contended=set())
    result = search(cpu)
    assert not any(again for _, _, again in cpu.calls) and not any("recompute" in n for n in result.notes)


class ContendedOffload(ContendedCPU):
    """As `ContendedCPU`, with activation offload in place of recompute: 12.5 ms a sample, 0.5 MiB a sample."""

    def run(self, rung: Rung, micro: int, *, again: bool = False) -> Trial:
        self.calls.append((rung, micro, again))
        offload = rung.offload != "none"
        seconds = 0.05 + 0.01 * micro * (1.25 if offload else 1.0)
        if not offload and micro in self.contended and not again:
            seconds *= 5
        return Trial(rung=rung, micro_batch_size=micro, outcome="ok", step_seconds=seconds, optimizer_seconds=0.0,
                     samples_per_second=micro / seconds, peak_bytes=int(micro * MiB * (0.5 if offload else 1.0)))


def test_an_offload_win_offloading_cannot_explain_is_remeasured_and_not_believed() -> None:
    cpu = ContendedOffload(contended={1, 2, 4})
    offload = Rung(precision="fp32", checkpointing="full", offload="activations")
    controller = Controller(cpu.run, per_rank=8, limit_bytes=int(4.5 * MiB),
                            remeasure=lambda rung, micro: cpu.run(rung, micro, again=True))
    result = controller.search([FULL, offload])
    again = [(r.offload, m) for r, m, a in cpu.calls if a]
    assert again[:2] == [("activations", 4), ("none", 4)], cpu.calls
    assert any("more than offloading can explain: both re-measured" in n for n in result.notes), result.notes


def test_a_trial_whose_steps_keep_losing_their_core_measures_longer_and_the_plan_says_so() -> None:
    calls = [0]

    def stalling_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] % 2:
            time.sleep(0.05)  # every other step waits, as if another process held the core
        return model(batch).square().mean()

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    plan = autotune.fit(model, torch.randn(4, 16), global_batch_size=4, device="cpu", memory_budget="64MiB",
                        cache=False, trial_steps=2, techniques=("bf16",), loss_fn=stalling_loss, progress=False)
    noisy = [t for t in plan.trials if "noisy timings" in t.note]
    # Up to 3x the 2 measured steps, or of the 4 a re-measurement runs; every noisy trial measured 3 times.
    assert noisy and all(("over 6 steps" in t.note or "over 12 steps" in t.note) and "measured 3 times" in t.note
                         for t in noisy), [t.note for t in plan.trials]
    assert "timings were noisy" in plan.reason, plan.reason


# -- a reading in doubt is measured again before it decides anything (search/noise.py) ------------------------

class BusyCPU:
    """A fixed 50 ms a micro-step plus 1 ms a sample, `per_sample` bytes a sample over 28 MiB. The first reading
    of each micro-batch in `busy` ran while another process held the cores for part of it (noisy steps, 3x as
    long), or, with `whole=True`, for all of it (steady steps, 3x as long)."""

    def __init__(self, busy: set[int], *, whole: bool = False, per_sample: int = 0) -> None:
        self.busy, self.whole, self.per_sample = busy, whole, per_sample
        self.calls: list[int] = []

    def steps(self, micro: int) -> list[float]:
        """The measured micro-steps' seconds of this reading (what a zero-change trial reports)."""
        self.calls.append(micro)
        step = 0.05 + 0.001 * micro
        if micro in self.busy and self.calls.count(micro) == 1:
            return [3 * step] * 3 if self.whole else [step, 3 * step, 5 * step]
        return [step] * 3

    def peak(self, micro: int) -> int:
        return 28 * MiB + micro * self.per_sample

    def trial(self, rung: Rung, micro: int, per_rank: int) -> Trial:
        steps = self.steps(micro)
        step = sorted(steps)[1]
        return Trial(rung=rung, micro_batch_size=micro, outcome="ok", peak_bytes=self.peak(micro),
                     step_seconds=step, optimizer_seconds=0.0, samples_per_second=micro / step,
                     noisy=spread([(s, 0.0) for s in steps]) > NOISY_SPREAD)


def test_one_noisy_reading_is_measured_again_before_it_decides_the_pick() -> None:
    # 1 MiB a sample under a 60 MiB limit: 1 and 2, then the prediction, 32, fits; nothing larger does. Read
    # once, 32's noisy steps make it slower than 2 and the pick 2 x 32 (on a CPU 3x slower than 32 x 2).
    cpu = BusyCPU({32}, per_sample=MiB)
    run = lambda rung, micro: cpu.trial(rung, micro, 64)  # noqa: E731
    result = Controller(run, per_rank=64, limit_bytes=60 * MiB, retry=run).search([PLAIN])
    assert cpu.calls == [1, 2, 32, 32]
    assert result.picked().micro_batch_size == 32 and not result.picked().noisy
    assert "measured 2 times" in result.picked().note
    assert len(result.trials) == 3  # the reading kept took the first one's place


def zero_change_tune(cpu: BusyCPU, device: str = "cpu") -> object:
    """`autotune run`'s zero-change search over scripted trials: the main job's flags, global batch 512, a
    memory ceiling far above what the script uses."""
    from autotune.supervisor.flags import FlagMap
    from autotune.supervisor.process import ChildExit
    from autotune.supervisor.verdict import classify
    from autotune.supervisor.zero_change import ScriptTrials, ScriptTuner, script_rungs

    def launch(args: list[str], env: dict[str, str]) -> object:
        micro = int(args[args.index("--per_device_train_batch_size") + 1])
        steps = cpu.steps(micro)
        if "--gradient_checkpointing" in args:
            steps = [1.3 * s for s in steps]  # a second forward
        record = {"outcome": "ok", "trial": {"step_seconds": steps, "optimizer_seconds": [0.001] * len(steps),
                                             "peak_bytes": cpu.peak(micro)}}
        return classify(ChildExit(returncode=0, seconds=1.0, output_tail=""), [record])

    flags = FlagMap.parse(["micro_batch=--per_device_train_batch_size", "accumulation=--gradient_accumulation_steps",
                           "checkpointing=--gradient_checkpointing"])
    rungs, notes = script_rungs(flags, frozenset({"checkpointing"}))
    trials = ScriptTrials(launch=launch, flags=flags, script_args=[], per_rank=512, world_size=1,
                          limit_bytes=int(0.9 * 4096 * MiB), trial_steps=3)
    tuner = ScriptTuner(trials=trials, rungs=rungs, notes=notes, global_batch_size=512, budget_bytes=4096 * MiB,
                        margin=0.1, device=device, device_name=device)
    return tuner.tune()


def test_zero_change_with_memory_flat_grows_the_micro_batch_while_it_pays() -> None:
    # Peak memory the same at every micro-batch: the memory line predicts nothing, each step doubles, and the
    # time line (50 ms a micro-step of fixed cost) says every doubling pays, far past 16.
    plan = zero_change_tune(BusyCPU(set()))
    assert plan.checkpointing == "none" and plan.micro_batch_size >= 64, plan.reason


@pytest.mark.parametrize("whole", [False, True], ids=["noisy steps", "a whole trial slowed"])
def test_one_reading_in_doubt_does_not_end_growth(whole: bool) -> None:
    # Micro-batch 16 read 3x slow once: believed, the time line through it says no larger micro-batch pays,
    # growth stops there and the pick is 8 x 64. Measured again, it is steady, and growth goes on.
    cpu = BusyCPU({16}, whole=whole)
    plan = zero_change_tune(cpu)
    assert cpu.calls.count(16) == 2, cpu.calls
    assert plan.checkpointing == "none" and plan.micro_batch_size >= 64, plan.reason
    assert "timings were noisy" not in plan.reason


def test_on_a_gpu_a_reading_stands_as_measured() -> None:
    cpu = BusyCPU({16})
    zero_change_tune(cpu, device="cuda")
    assert cpu.calls.count(16) == 1, cpu.calls


def test_the_reasons_factors_are_ratios_of_the_trial_tables_rates() -> None:
    # The recompute "win" measured on contended trials is re-measured: the reason quotes the figures in the
    # table (the re-measurements), never the factor of the first readings they replaced.
    cpu = ContendedCPU(contended={1, 2, 4})
    result = search(cpu)
    text = reason(result, result.notes)
    rates = [t.samples_per_second for t in result.trials if t.fits]
    ratios = {f"{a / b:.2f}" for a in rates for b in rates}
    factors = re.findall(r"(\d+\.\d\d)x", text)
    assert factors and set(factors) <= ratios, (factors, text)
