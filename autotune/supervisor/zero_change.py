"""Zero-change mode of `autotune run`: tune a script that knows nothing of autotune through its own flags.

`--map micro_batch=--per_device_train_batch_size --map accumulation=--gradient_accumulation_steps`
(optionally `checkpointing=FLAG`, `bf16=FLAG`, `compile=FLAG`, each with an optional value template), or
a `--preset`, says which of the script's flags carry the plan's knobs (`flags.py`). Each trial runs the script in a
fresh process through the agent (`agent.py`), with accumulation 1, for one warm-up and `trial_steps` measured optimizer
steps; the controller's predict / verify / bisect / score-by-throughput search decides which trial comes next,
restricted to micro-batches that divide the per-rank batch (the script batches its own data, so only an exact split
keeps the global batch).
"""

from __future__ import annotations

import logging
import shlex
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from .. import settings
from ..configuration import Rung
from ..devices import nvml, placement
from ..devices.placement import NO_NATIVE_BF16, check_budget
from ..errors import DeviceError, InvalidSetting
from ..evidence import Finding, Trial
from ..plan import Plan
from ..search.controller import Controller, Lattice
from ..search.progress import Progress
from ..search.trial import NOISY, NOISY_SPREAD, noise_note, spread
from ..sizes import format_bytes, format_share, parse_bytes, shorten
from ..workload.batching import global_step_seconds
from .agent import STEPS_ENV
from .flags import FlagMap
from .process import ChildExit
from .verdict import Verdict

log = logging.getLogger(__name__)
CPU_SCRIPT_BF16 = ("a script's bf16 flag is written for a GPU (the HF Trainer's --bf16 refuses the CPU); "
                   "autotune.fit measures bf16 on this CPU")


def script_rungs(flags: FlagMap, allowed: frozenset[str], bf16_off: str = "") -> tuple[list[Rung], list[str]]:
    """The rungs a script's flags can express, cheapest first, and notes on what was left out.

    Without a mapped bf16 flag the script keeps its own precision; the plan says "fp32" for it.
    `bf16_off` is why the device should not use bf16, if it should not. Compile is not a rung here: the
    search places it beside the fastest eager configuration (`compile_searched`).
    """
    notes: list[str] = []
    precision = "fp32"
    if flags.bf16 is None:
        notes.append("precision is the script's own (no --map bf16=FLAG)")
    elif "bf16" not in allowed:
        notes.append("bf16 not among the allowed techniques")
    elif bf16_off:
        notes.append(f"bf16 left off: {bf16_off}")
    else:
        precision = "bf16"
    rungs = [Rung(precision=precision)]
    if flags.checkpointing is not None and "checkpointing" in allowed:
        rungs.append(Rung(precision=precision, checkpointing="full"))
    elif flags.checkpointing is None:
        notes.append("no checkpointing rung (no --map checkpointing=FLAG)")
    return rungs, notes


def nothing_fits_advice(flags: FlagMap) -> str:
    """What to change on `autotune run`'s command line when nothing fits: the budget, the knobs left unmapped."""
    unmapped = [f"--map {knob}=FLAG" for knob in ("checkpointing", "bf16") if getattr(flags, knob) is None]
    more = f", map more of the script's flags ({', '.join(unmapped)})" if unmapped else ""
    return f"Raise --budget{more}, or shrink the model or the sequence."


def compile_searched(flags: FlagMap, allowed: frozenset[str], target: Target) -> tuple[bool, str]:
    """Whether the search may try the script compiled, and a note when it may not though the flag is mapped."""
    if flags.compile is None:
        return False, ""
    if "compile" not in allowed:
        return False, "compile not among the allowed techniques"
    if target.compile_off:
        return False, f"compile left off: {target.compile_off}"
    return True, ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """Where the script will run, as far as the supervisor can tell without creating a CUDA context."""

    kind: str  # "cuda" | "cpu"
    name: str
    budget_bytes: int
    apply_budget: bool  # give the agent a ceiling: always on the CPU (it is how peaks are measured there)
    bf16_off: str = ""  # why bf16 should stay off here, if it should
    compile_off: str = ""  # why torch.compile should stay off here, if it should
    total_bytes: int = 0  # the device's memory, for the cache key (0 where unknown)


def resolve_target(device: str | None, budget: str | None) -> Target:
    """The device the script will use, its budget, and bf16 support (DeviceError when a GPU is missing)."""
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    given = parse_bytes(budget, "--budget") if budget is not None else None
    if kind == "cpu":
        # A script's bf16 flag is written for a GPU (the HF Trainer's --bf16 refuses a CPU without use_cpu), and
        # where the CPU has no native bf16 it would be emulated and slow: on the CPU the script keeps fp32.
        name, host = "cpu (simulated ceiling)", psutil.virtual_memory().total
        return Target(kind="cpu", name=name, apply_budget=True,
                      budget_bytes=check_budget(given, host, name, "--budget") if given else
                      psutil.virtual_memory().available,
                      bf16_off=CPU_SCRIPT_BF16 if placement.cpu_has_native_bf16() else NO_NATIVE_BF16,
                      compile_off="compiling on the CPU takes longer than the trials it would speed up",
                      total_bytes=host)
    if not kind.startswith("cuda"):
        raise InvalidSetting(f"--device {device!r}: pass 'cuda' or 'cpu'")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {kind} but torch sees no CUDA GPU (torch {torch.__version__}, CUDA build "
                          f"{torch.version.cuda}); run `autotune doctor`, or pass --device cpu to simulate one")
    index = torch.device(kind).index or 0
    gpu = nvml.visible_gpu(index)
    if gpu is not None:
        name, free, total, bf16 = gpu.name, gpu.free_bytes, gpu.total_bytes, gpu.bf16
    else:  # NVML could not say: ask CUDA (this costs a context in the supervisor)
        name, (free, total) = torch.cuda.get_device_name(index), torch.cuda.mem_get_info(index)
        bf16 = torch.cuda.get_device_capability(index) >= (8, 0)
    if given:
        check_budget(given, total, name, "--budget")
    return Target(kind="cuda", name=name, budget_bytes=given or free, apply_budget=given is not None,
                  bf16_off="" if bf16 else f"{name} has no bf16 support", total_bytes=int(total))


THREADS_ENV = "OMP_NUM_THREADS"  # torch's intra-op threads in the job, read when it imports torch


def job_threads(target: Target, environ: Mapping[str, str]) -> dict[str, str]:
    """On the CPU, one intra-op thread for the job, its trials and its real run alike, unless `environ` (the
    supervisor's environment, which the job inherits) sets OMP_NUM_THREADS; else nothing.

    The simulated device times steps in the job's CPU time so that neighbours' work is not charged to the plan.
    With several intra-op threads it is: on cores that other processes hold, torch's OpenMP threads spin while
    they wait for each other, a step's CPU time grows with the machine's load, and which micro-batch measures
    fastest changes with it. One thread measures the work alone, the same in trials and in the run.
    """
    if target.kind != "cpu" or THREADS_ENV in environ:
        return {}
    return {THREADS_ENV: "1"}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class TrialFailed(Exception):
    """A trial ended in a way that is not a memory verdict; carries what the supervisor needs to report."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# Runs the script once with these arguments and extra environment variables, and says how it ended.
Launch = Callable[[list[str], dict[str, str]], Verdict]


@dataclass(kw_only=True)
class ScriptTrials:
    """The controller's trial runner for a script: `(rung, micro) -> Trial`, each in a fresh process.

    Trials are remembered, so a re-tune after a real-run OOM (with a lower micro-batch cap) reuses them.
    `known` holds global-step rates a real run measured for a (rung, micro-batch): they replace the
    trial's own estimate (many whole steps of the real thing outweigh three of a trial).
    """

    launch: Launch
    flags: FlagMap
    script_args: Sequence[str]
    per_rank: int
    world_size: int
    limit_bytes: int
    trial_steps: int
    env: dict[str, str] = field(default_factory=dict)
    known: dict[tuple[Rung, int], float] = field(default_factory=dict)
    _memo: dict[tuple[Rung, int], Trial] = field(default_factory=dict)
    # (start-up, whole trial) seconds of each trial that ran: start-up is the process's age at its first step
    startups: list[tuple[float, float]] = field(default_factory=list)
    forked: Callable[[], str] = str  # what the trials forked from, if they did (Launcher.forked)

    def __call__(self, rung: Rung, micro: int) -> Trial:
        key = (rung, micro)
        if key not in self._memo:
            self._memo[key] = self._run(rung, micro)
        return self._memo[key]

    def again(self, rung: Rung, micro: int) -> Trial:
        """A fresh trial of `rung` at `micro`, for a reading in doubt (search/noise.py); the remembered one stays."""
        return self._run(rung, micro)

    def _run(self, rung: Rung, micro: int) -> Trial:
        args = self.flags.apply(self.script_args, micro=micro, accumulation=1, rung=rung)
        log.debug("trial %d: %s at micro-batch %d (%d optimizer steps)...", len(self._memo) + 1, rung.name, micro,
                 1 + self.trial_steps)
        log.debug("trial command: %s", shlex.join(args))
        ended = self.launch(args, {**self.env, STEPS_ENV: str(1 + self.trial_steps),
                                   settings.AGENT_LAUNCHED_ENV: repr(time.time())})
        if ended.kind == "oom":
            return Trial(rung=rung, micro_batch_size=micro, outcome="oom", seconds=ended.exit.seconds,
                         note=shorten(ended.note, 200))
        if ended.kind != "ok":
            hint = (f"; raise --trial-timeout if the script needs longer to start and make {1 + self.trial_steps} "
                    "optimizer steps" if ended.kind == "timeout" else "")
            raise TrialFailed(f"trial {len(self._memo) + 1} ({rung.name} at micro-batch {micro}): {ended.note}{hint}",
                              ended.exit_code)
        measured = [r["trial"] for r in ended.records if isinstance(r.get("trial"), dict)]
        if not measured:
            steps = max((r.get("steps") or 0 for r in ended.records), default=0)
            raise InvalidSetting(
                f"the script finished after {steps} optimizer step(s) at micro-batch {micro}; a trial needs "
                f"{1 + self.trial_steps}. Give it more data or steps, or lower --trial-steps (at least 1).")
        starts = [m["startup_seconds"] for m in measured if m.get("startup_seconds") is not None]
        if starts:  # (the launch time is stamped a moment before the job's clock starts: never more than whole)
            self.startups.append((min(max(starts), ended.exit.seconds), ended.exit.seconds))
        return self._trial(rung, micro, measured, ended.exit)

    def startup_finding(self) -> Finding | None:
        """How much of a trial was start-up (the median over the trials run), for the plan's reason; None before
        any trial said."""
        if not self.startups:
            return None
        start, whole = (statistics.median(x) for x in zip(*self.startups))
        share = format_share(min(1.0, start / whole)) if whole > 0 else "?"
        forked = self.forked()
        what = ("building the model and data, and the first step; " + forked if forked else
                "the interpreter, imports, building the model and data, and the first step")
        return Finding(kind="startup", clause=f"trials: start-up {start:.1f} s of {whole:.1f} s each ({share}: {what})",
                       figures={"startup_seconds": start, "trial_seconds": whole})

    def _trial(self, rung: Rung, micro: int, measured: list[dict[str, Any]], exit_: ChildExit) -> Trial:
        # Ranks step in lockstep; the slowest and the fullest rank decide.
        step_s = max(statistics.median(m["step_seconds"]) for m in measured)
        opt_s = max(statistics.median(m["optimizer_seconds"]) for m in measured)
        peak = max([int(m["peak_bytes"]) for m in measured] + [exit_.peak_gpu_bytes or 0])
        per_step = global_step_seconds(step_s, opt_s, self.per_rank, micro)
        rate = self.per_rank * self.world_size / per_step if per_step > 0 else 0.0
        fits = peak <= self.limit_bytes
        wide = max(spread(list(zip(m["step_seconds"], m["optimizer_seconds"]))) for m in measured)
        noisy = f"{NOISY} (step times spread {wide:.0%})" if wide > NOISY_SPREAD else ""
        note = noisy if fits else (f"peak {format_bytes(peak)} is above the {format_bytes(self.limit_bytes)} "
                                   "limit (budget less margin)")
        if (rung, micro) in self.known:
            note = f"samples/s as a real run trained (the trial estimated {rate:,.1f})" + (f"; {note}" if note else "")
            rate = self.known[(rung, micro)]
        return Trial(rung=rung, micro_batch_size=micro, outcome="ok" if fits else "over_budget", peak_bytes=peak,
                     seconds=exit_.seconds, step_seconds=step_s, optimizer_seconds=opt_s, samples_per_second=rate,
                     alloc_retries=max(int(m.get("alloc_retries", 0)) for m in measured),
                     noisy=fits and wide > NOISY_SPREAD, note=note)


@dataclass(kw_only=True)
class ScriptTuner:
    """Searches the script's flag space and turns the winner into a `Plan`."""

    trials: ScriptTrials
    rungs: list[Rung]
    notes: list[str]
    global_batch_size: int
    budget_bytes: int
    margin: float
    device: str  # "cuda" | "cpu"
    device_name: str
    compile: bool = False  # the search may try the script compiled (`compile_searched`)
    progress: Progress | None = None  # tells a person each trial as it runs (search/progress.py)

    def tune(self, max_micro: int | None = None) -> Plan:
        """The best plan with micro-batch at most `max_micro`; raises `NoFeasiblePlan` when nothing fits."""
        t, progress = self.trials, self.progress
        # On the CPU another process can take the cores mid-trial: a reading in doubt is measured again.
        retry = t.again if self.device == "cpu" else None
        try:
            return self._tune(progress.watch(t) if progress else t,
                              progress.watch(retry, "re-measure") if progress and retry else retry, max_micro)
        finally:
            if progress is not None:
                progress.close()

    def _tune(self, runner: Callable[[Rung, int], Trial], retry: Callable[[Rung, int], Trial] | None,
              max_micro: int | None) -> Plan:
        t = self.trials
        controller = Controller(runner, per_rank=t.per_rank, limit_bytes=t.limit_bytes, max_micro=max_micro,
                                world_size=t.world_size, sizes=divisors(t.per_rank), retry=retry,
                                advice=nothing_fits_advice(t.flags))
        result = controller.search(self.rungs, Lattice(compile=True) if self.compile else None)
        best = result.picked()
        # After the controller's account: the first two notes, the noise, and how much of a trial was start-up.
        findings = [Finding(kind="note", clause=n) for n in [*self.notes, *result.notes][:2]]
        noisy = noise_note(result.trials)
        if noisy:
            findings.append(Finding(kind="noise", clause=noisy, figures={
                "noisy_trials": sum(x.fits and x.noisy for x in result.trials)}))
        startup = t.startup_finding()
        if startup is not None:
            findings.append(startup)
        return Plan.of(precision=best.rung.precision, checkpointing=best.rung.checkpointing, offload="none",
                    micro_batch_size=best.micro_batch_size, accumulation_steps=t.per_rank // best.micro_batch_size,
                    world_size=t.world_size, global_batch_size=self.global_batch_size,
                    last_micro_batch_size=best.micro_batch_size, peak_memory_bytes=best.peak_bytes,
                    memory_budget_bytes=self.budget_bytes, margin=self.margin,
                    samples_per_second=best.samples_per_second, device=self.device, device_name=self.device_name,
                    source="tuned", account=result.head, findings=tuple(findings),
                    trials=tuple(result.trials), compile=best.rung.compile)

    def arguments(self, plan: Plan) -> list[str]:
        """The script's arguments for the real run with `plan`."""
        return self.trials.flags.apply(self.trials.script_args, micro=plan.micro_batch_size,
                                       accumulation=plan.accumulation_steps, rung=plan.rung)
