"""Zero-change mode on the frameworks people use: real Lightning and real Hugging Face Trainer scripts.

End to end: `autotune run --preset lightning-cli` / `--preset hf-trainer` (run inside the test's process through
click's test runner; its trials and training are real processes) tunes the example scripts on the CPU under a
simulated ceiling, trains with the plan, exits 0, and the plan's claimed samples/s is within
1.5x of what the real run measured (the run's whole optimizer steps, timed by the agent), at once or, where a
trial read fast, at the next tune, which takes the run's measurement in its place. In process: the
step watch against real Lightning training, with forward and backward inside `optimizer.step(closure)`
and with manual optimization; presets and value templates; and what the cache keeps of a run's
measurement, with a scripted launcher (the decision logic, exact and fast).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import threading
import time
from pathlib import Path

import cli_here
import pytest
import torch
from cli_here import RunHere
from click.testing import CliRunner

from autotune.cli.main import main
from autotune.configuration import Rung
from autotune.errors import InvalidSetting
from autotune.plan import Plan
from autotune.supervisor import claims, runner
from autotune.supervisor.flags import PRESETS, FlagMap
from autotune.supervisor.measure import StepWatch
from autotune.supervisor.process import ChildExit
from autotune.supervisor.verdict import classify

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT = 600  # one tune (a fresh process per trial: ~15 s of imports each on a loaded two-core machine) and a run
CLAIM_WITHIN = 1.5  # the bar: claimed and measured samples/s within this factor


@pytest.fixture
def autotune_run(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> RunHere:
    """`autotune run ARGS...` in this process (`cli_here`), with this test's cache."""
    env = {"AUTOTUNE_CACHE": str(tmp_path / "plans.db"), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    return lambda *args: cli_here.run_here(capfd, args, env=env, timeout=TIMEOUT)


def check_tuned_and_trained(done: subprocess.CompletedProcess[str], budget_mib: int, per_rank: int) -> Plan:
    """Exit 0, a plan under the ceiling that the ceiling shaped, and the run's measured rate; the plan."""
    assert done.returncode == 0, done.stderr[-4000:]
    plan = Plan.from_dict(json.loads(done.stdout))  # --json: the plan (with what the run measured), and nothing else
    assert plan.peak_memory_bytes <= 0.9 * budget_mib * 2**20
    assert plan.micro_batch_size * plan.accumulation_steps == per_rank
    # The ceiling rules out the whole batch in one micro-batch without recompute (it fits only a smaller
    # micro-batch, or with checkpointing): the plan is one of those.
    assert plan.micro_batch_size < per_rank or plan.checkpointing != "none", plan.reason
    assert all(t.outcome != "ok" for t in plan.trials
               if t.micro_batch_size == per_rank and t.rung.checkpointing == "none")
    assert plan.measured_samples_per_second is not None, done.stderr[-4000:]  # it made and timed its steps
    return plan


def claim_ratio(plan: Plan) -> float:
    return plan.samples_per_second / plan.measured_samples_per_second


def tune_train_and_hold_the_claim(autotune_run: RunHere, args: tuple[str, ...], budget_mib: int,
                                  per_rank: int) -> tuple[Plan, subprocess.CompletedProcess[str]]:
    """`autotune run` tunes, trains, and its claim is within 1.5x of what the run measured.

    Trials time a few steps on a shared two-core machine; once in many runs (CI, 2026-11-27: claimed 237,
    trained 145 samples/s) a trial reads fast. The product's answer is to record the run's measurement
    against the plan and take it in place of the trial's estimate at the next tune: that is checked here,
    by running again against the same cache, and the second claim must hold.
    """
    done = autotune_run(*args)
    plan = check_tuned_and_trained(done, budget_mib, per_rank)
    if 1 / CLAIM_WITHIN <= claim_ratio(plan) <= CLAIM_WITHIN:
        return plan, done
    assert "recorded against the plan, so its next tune re-measures" in done.stderr, done.stderr[-3000:]
    again = autotune_run(*args)
    assert "re-tuning, with that configuration scored at the measured rate" in again.stderr, again.stderr[-3000:]
    plan = check_tuned_and_trained(again, budget_mib, per_rank)
    assert 1 / CLAIM_WITHIN <= claim_ratio(plan) <= CLAIM_WITHIN, (plan.samples_per_second,
                                                                   plan.measured_samples_per_second,
                                                                   again.stderr[-3000:])
    return plan, again


# -- end to end: real frameworks under `autotune run` -------------------------------------------------------

@pytest.mark.slow
def test_lightning_cli_preset_tunes_trains_and_its_claim_holds(autotune_run: RunHere) -> None:
    args = ("--preset", "lightning-cli", "--global-batch-size", "8", "--budget", "8MiB", "--trial-steps", "4",
            "--json", "--map", "checkpointing=--model.gradient_checkpointing=true",
            str(EXAMPLES / "train_lightning.py"), "fit", "--trainer.max_steps", "12", "--model.layers", "2",
            "--model.width", "64")
    plan, done = tune_train_and_hold_the_claim(autotune_run, args, budget_mib=8, per_rank=8)
    micro, accumulation = plan.micro_batch_size, plan.accumulation_steps
    assert f"--data.batch_size {micro} --trainer.accumulate_grad_batches {accumulation}" in done.stderr
    assert "max_steps=12` reached" in done.stderr  # Lightning's own word that it trained to the end


@pytest.mark.slow
def test_hf_trainer_preset_tunes_trains_and_its_claim_holds(tmp_path: Path, autotune_run: RunHere) -> None:
    args = ("--preset", "hf-trainer", "--global-batch-size", "8", "--budget", "24MiB", "--trial-steps", "4", "--json",
            str(EXAMPLES / "train_hf_trainer.py"), "--model_size", "tiny", "--seq_len", "64", "--vocab_size", "512",
            "--max_steps", "12", "--logging_steps", "100", "--output_dir", str(tmp_path / "out"))
    plan, done = tune_train_and_hold_the_claim(autotune_run, args, budget_mib=24, per_rank=8)
    micro, accumulation = plan.micro_batch_size, plan.accumulation_steps
    assert f"--per_device_train_batch_size {micro} --gradient_accumulation_steps {accumulation}" in done.stderr
    assert "trained 12 steps" in done.stderr  # the script's own report of the finished run


@pytest.mark.slow
def test_a_cooperative_runs_steps_are_counted_from_its_plan_on_and_stored_on_the_cached_plan(
        tmp_path: Path, autotune_run: RunHere) -> None:
    """fit's own trials step optimizers too: the count restarts when fit reports its plan."""
    from autotune.cache.store import PlanCache

    done = autotune_run("--global-batch-size", "8", "--budget", "40MiB", "--trial-steps", "1", "--json",
                        str(EXAMPLES / "train_cooperative.py"), "--steps", "6", "--layers", "1", "--width", "32",
                        "--checkpoint", str(tmp_path / "ck.pt"))
    assert done.returncode == 0, done.stderr[-4000:]
    plan = Plan.from_dict(json.loads(done.stdout))
    assert "median of 5 whole optimizer steps" in done.stderr  # 6 training steps, the first not timed
    assert plan.measured_samples_per_second > 0
    with PlanCache(tmp_path / "plans.db") as cache:
        assert cache.get(plan.key).measured_samples_per_second == pytest.approx(plan.measured_samples_per_second)


# -- the step watch inside real Lightning training ---------------------------------------------------------

COMPUTE_SECONDS = 0.05  # a training step's known cost, slept inside it


class _Sleepy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        time.sleep(COMPUTE_SECONDS)  # forward+backward of a model worth timing, without the CPU cost
        return self.layer(batch).pow(2).mean()


def _lightning_fit(module: object, steps: int) -> None:
    import lightning.pytorch as pl

    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(torch.randn(64, 8), batch_size=4))


@pytest.fixture
def watch() -> StepWatch:
    w = StepWatch(now=time.perf_counter)
    w.install()
    yield w
    w.remove()


@pytest.mark.slow  # the first of these in a process imports Lightning: seconds of CPU
def test_a_closure_step_is_timed_whole_and_the_optimizer_share_told_apart(watch: StepWatch) -> None:
    """Lightning runs forward and backward inside optimizer.step(closure): the step is all of it."""
    import lightning.pytorch as pl

    class Automatic(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Sleepy()

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net.loss(batch)

        def configure_optimizers(self) -> dict:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    _lightning_fit(Automatic(), steps=5)
    assert watch.count == 5  # the scheduler's steps are not optimizer steps
    assert watch.closure_steps == 4 == len(watch.step_seconds)  # every measured step ran inside step(closure)
    assert min(watch.step_seconds) >= COMPUTE_SECONDS
    # The optimizer's own share is the step() call less the closure: AdamW on 9 weights, not the sleep.
    assert statistics.median(watch.optimizer_seconds) < COMPUTE_SECONDS / 2
    assert all(o < w for o, w in zip(watch.optimizer_seconds, watch.step_seconds))


@pytest.mark.slow  # the first of these in a process imports Lightning: seconds of CPU
def test_manual_optimization_stepping_every_other_batch_is_one_step_per_update(watch: StepWatch) -> None:
    """The loop calls step() itself (here every second batch, its own accumulation) and the scheduler after it."""
    import lightning.pytorch as pl

    class Manual(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.net = _Sleepy()

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            self.manual_backward(self.net.loss(batch) / 2)
            if batch_idx % 2 == 1:
                opt = self.optimizers()
                opt.step()
                opt.zero_grad()
                self.lr_schedulers().step()

        def configure_optimizers(self) -> tuple[list, list]:
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1)]

    _lightning_fit(Manual(), steps=4)
    assert watch.count == 4
    # From one update's end to the next's: both batches of the update are inside it.
    assert min(watch.step_seconds) >= 2 * COMPUTE_SECONDS
    assert statistics.median(watch.optimizer_seconds) < COMPUTE_SECONDS / 2


def test_a_wrapper_optimizer_and_a_second_optimizer_fall_inside_the_first_optimizers_step(watch: StepWatch) -> None:
    weights = [torch.nn.Parameter(torch.ones(3))]
    inner = torch.optim.SGD(weights, lr=0.1)

    class Wrapper(torch.optim.Optimizer):  # as a framework's wrapper that is itself hooked
        def __init__(self) -> None:
            super().__init__(weights, {})

        def step(self, closure=None):  # torch's signature
            return inner.step(closure)

    wrapper = Wrapper()
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    for _ in range(3):
        weights[0].grad = torch.ones(3)
        wrapper.step()
        other.step()
        worker = threading.Thread(target=other.step)  # as offload's host chunks, stepped on a worker
        worker.start()
        worker.join()
    assert watch.count == 3 and len(watch.step_seconds) == 2
    def failing_step(closure=None):
        raise RuntimeError("a step that failed")

    inner.step = failing_step
    with pytest.raises(RuntimeError, match="failed"):  # caught by the loop, which goes on
        wrapper.step()
    del inner.step
    weights[0].grad = torch.ones(3)
    wrapper.step()
    assert watch.count == 4  # the failed step() left no nesting open


# -- presets and value templates ----------------------------------------------------------------------------

def test_the_hf_trainer_preset_maps_every_knob() -> None:
    flags = FlagMap.parse([], "hf-trainer")
    args = ["--output_dir", "out", "--per_device_train_batch_size", "64", "--gradient_accumulation_steps=1", "--bf16"]
    assert flags.global_batch(args, world_size=2) == 128
    rung = Rung(precision="bf16", checkpointing="full", compile=True)
    assert flags.apply(args, micro=4, accumulation=16, rung=rung) == [
        "--output_dir", "out", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "16",
        "--gradient_checkpointing", "--bf16", "--torch_compile"]
    assert flags.apply(args, micro=8, accumulation=8, rung=Rung(precision="fp32"))[-4:] == [
        "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "8"]


def test_a_value_template_passes_its_value_when_on_and_drops_the_flag_when_off() -> None:
    flags = FlagMap.parse(["checkpointing=--model.gradient_checkpointing=true"], "lightning-cli")
    args = ["fit", "--trainer.precision", "32-true", "--data.batch_size=16", "--trainer.accumulate_grad_batches", "2"]
    assert flags.global_batch(args, world_size=1) == 32
    on = flags.apply(args, micro=2, accumulation=16, rung=Rung(precision="bf16", checkpointing="full"))
    assert on == ["fit", "--data.batch_size", "2", "--trainer.accumulate_grad_batches", "16",
                  "--model.gradient_checkpointing=true", "--trainer.precision=bf16-mixed"]
    off = flags.apply(on, micro=32, accumulation=1, rung=Rung(precision="fp32"))
    assert off == ["fit", "--data.batch_size", "32", "--trainer.accumulate_grad_batches", "1"]


def test_a_map_beside_a_preset_overrides_its_entry() -> None:
    flags = FlagMap.parse(["micro_batch=--data.train_batch_size"], "lightning-cli")
    assert flags.micro_batch == "--data.train_batch_size"
    assert flags.accumulation == "--trainer.accumulate_grad_batches"


@pytest.mark.parametrize(("entries", "preset", "match"), [
    (["micro_batch=--bs=4", "accumulation=--acc"], None, "takes the plan's number"),
    (["micro_batch=--bs", "accumulation=--acc", "bf16=--precision="], None, "empty"),
    (["micro_batch=--bs", "accumulation=--acc", "fp8=--fp8"], None, "KNOB one of"),
    ([], "deepspeed", "--preset 'deepspeed' is not known; pass one of hf-trainer, lightning-cli"),
    (["bf16=--bf16"], None, "needs --map micro_batch"),
])
def test_bad_maps_and_presets_say_what_to_write(entries: list[str], preset: str | None, match: str) -> None:
    with pytest.raises(InvalidSetting, match=match):
        FlagMap.parse(entries, preset)


def test_run_help_lists_the_presets_with_examples() -> None:
    result = CliRunner().invoke(main, ["run", "--help"])
    assert result.exit_code == 0
    for name, preset in PRESETS.items():
        assert f"{name}: " in result.output and preset.example in result.output.replace("\n      ", " ")
    assert "bf16=--trainer.precision=bf16-mixed" in result.output
    unknown = CliRunner().invoke(main, ["run", "--preset", "deepspeed", "tests/scripts/exit7.py"])
    assert unknown.exit_code == 2 and "hf-trainer" in unknown.output  # a usage error naming the presets


# -- what the cache keeps of a run's measurement (scripted launcher) -----------------------------------------

STEP_SECONDS = 0.01  # the scripted trials' micro-step; the optimizer step is 1 ms


def _scripted(monkeypatch: pytest.MonkeyPatch, real_step_seconds: float) -> list[tuple[bool, int]]:
    """Trials fit up to micro-batch 8 and time STEP_SECONDS a micro-step; the real run times `real_step_seconds`
    a whole optimizer step (20 of them)."""
    calls: list[tuple[bool, int]] = []

    def launch(self: runner.Launcher, args: list[str], env: dict[str, str], *, trial: bool = False):
        micro = int(args[args.index("--bs") + 1])
        calls.append((trial, micro))
        if trial and micro > 8:
            return classify(ChildExit(returncode=1, seconds=1.0, output_tail=""),
                            [{"outcome": "oom", "error": "OutOfMemoryError: out of memory"}])
        record = ({"outcome": "ok", "trial": {"step_seconds": [STEP_SECONDS] * 3, "optimizer_seconds": [0.001] * 3,
                                              "peak_bytes": micro * 2**20}} if trial else
                  {"outcome": "ok", "measured": {"steps": 20, "measured_steps": 19,
                                                 "median_step_seconds": real_step_seconds}})
        return classify(ChildExit(returncode=0, seconds=1.0, output_tail=""), [record])

    monkeypatch.setattr(runner.Launcher, "launch", launch)
    return calls


def _options(tmp_path: Path) -> runner.RunOptions:
    script = tmp_path / "train.py"
    if not script.exists():
        script.write_text("# a script that takes --bs and --acc\n")
    return runner.RunOptions(script=str(script), maps=("micro_batch=--bs", "accumulation=--acc"),
                             global_batch_size=32, device="cpu", budget="1GiB", cache=str(tmp_path / "plans.db"))


CLAIMED_STEP = 4 * STEP_SECONDS + 0.001  # the plan the scripted search picks: micro-batch 8 x 4, one optimizer step


def test_a_confirmed_claim_is_reused_from_the_cache_without_trials(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    calls = _scripted(monkeypatch, real_step_seconds=CLAIMED_STEP * 1.1)
    first = runner.run(_options(tmp_path))
    assert first.exit_code == 0, first.message
    assert (first.plan.micro_batch_size, first.plan.accumulation_steps) == (8, 4)
    assert first.plan.measured_samples_per_second == pytest.approx(32 / (CLAIMED_STEP * 1.1))
    assert not claims.plan_disagrees(first.plan)
    calls.clear()
    second = runner.run(_options(tmp_path))
    assert calls == [(False, 8)]  # no trial: the real run started at once with the cached plan
    assert second.plan.source == "cache" and second.plan.micro_batch_size == 8


def test_a_claim_the_run_contradicts_is_recorded_and_the_next_tune_scores_it_as_it_trained(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from autotune.cache.store import PlanCache

    calls = _scripted(monkeypatch, real_step_seconds=CLAIMED_STEP * 3)  # the run is 3x slower than claimed
    first = runner.run(_options(tmp_path))
    assert first.exit_code == 0, first.message
    claimed, measured = first.plan.samples_per_second, first.plan.measured_samples_per_second
    assert measured == pytest.approx(claimed / 3, rel=0.01) and claims.plan_disagrees(first.plan)
    with PlanCache(tmp_path / "plans.db") as cache:
        (entry,) = cache.entries()
    assert entry.plan.measured_samples_per_second == pytest.approx(measured)  # recorded against the plan
    calls.clear()
    second = runner.run(_options(tmp_path))
    assert any(trial for trial, _ in calls), "a contradicted plan is re-tuned, not reused"
    scored = [t for t in second.plan.trials if t.micro_batch_size == 8 and t.rung == first.plan.rung]
    assert scored and scored[0].samples_per_second == pytest.approx(measured)
    assert "as a real run trained" in scored[0].note
    assert second.plan.samples_per_second < claimed / 1.5  # the over-claim is gone from the new plan


def test_measured_rate_is_the_global_batch_over_the_slowest_ranks_median_step() -> None:
    records = [{"measured": {"steps": 10, "measured_steps": 9, "median_step_seconds": 0.5}},
               {"measured": {"steps": 10, "measured_steps": 9, "median_step_seconds": 0.8}}, {"outcome": "ok"}]
    run = claims.measured(records, global_batch_size=64)
    assert run is not None and run.samples_per_second == pytest.approx(64 / 0.8)
    assert claims.measured([{"outcome": "ok", "steps": 1}], 64) is None  # one step: nothing timed
    assert not claims.disagrees(100.0, 100.0 / claims.NOISE_BAND) and claims.disagrees(100.0, 70.0)


def test_the_hf_trainer_presets_compile_flag_is_searched_beside_the_fastest_eager_plan() -> None:
    """On a GPU the preset's --torch_compile is a knob: a scripted trial that trains 0.6x the time compiled wins."""
    from autotune.supervisor.zero_change import ScriptTrials, ScriptTuner, Target, compile_searched, script_rungs

    launched: list[list[str]] = []

    def launch(args: list[str], env: dict[str, str]):
        launched.append(args)
        micro = int(args[args.index("--per_device_train_batch_size") + 1])
        if micro > 8:
            return classify(ChildExit(returncode=1, seconds=1.0, output_tail=""),
                            [{"outcome": "oom", "error": "OutOfMemoryError: CUDA out of memory"}])
        step = STEP_SECONDS * (0.6 if "--torch_compile" in args else 1.0)
        record = {"outcome": "ok", "trial": {"step_seconds": [step] * 3, "optimizer_seconds": [0.001] * 3,
                                             "peak_bytes": micro * 2**20}}
        return classify(ChildExit(returncode=0, seconds=1.0, output_tail=""), [record])

    flags = FlagMap.parse([], "hf-trainer")
    gpu = Target(kind="cuda", name="a GPU", budget_bytes=16 * 2**20, apply_budget=True)
    allowed = frozenset({"bf16", "checkpointing", "compile"})
    rungs, notes = script_rungs(flags, allowed)
    searched, note = compile_searched(flags, allowed, gpu)
    assert searched and not note
    cpu = Target(kind="cpu", name="cpu", budget_bytes=1, apply_budget=True, compile_off="slow there")
    assert compile_searched(flags, allowed, cpu) == (False, "compile left off: slow there")
    trials = ScriptTrials(launch=launch, flags=flags, script_args=["--output_dir", "out"], per_rank=32, world_size=1,
                          limit_bytes=int(0.9 * 16 * 2**20), trial_steps=3)
    tuner = ScriptTuner(trials=trials, rungs=rungs, notes=notes, global_batch_size=32, budget_bytes=16 * 2**20,
                        margin=0.1, device="cuda", device_name="a GPU", compile=True)
    plan = tuner.tune()
    assert any("--torch_compile" in args for args in launched)
    assert plan.compile and plan.micro_batch_size == 8
    assert tuner.arguments(plan) == ["--output_dir", "out", "--per_device_train_batch_size", "8",
                                     "--gradient_accumulation_steps", "4", "--bf16", "--torch_compile"]
