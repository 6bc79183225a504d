"""The `autotune run` supervisor: launch a training script, watch it, and restart it after an OOM.

Two modes:

- Cooperative: the script calls `autotune.fit`; the run's options reach it as `AUTOTUNE_*` environment
  variables. When the job dies of an OOM, the failure is recorded in the plan cache under the job's own key
  (its plan's key without the restart's cap), and the script is restarted with `AUTOTUNE_MAX_MICRO_BATCH`
  below the failed micro-batch (so a smaller plan comes back even with the cache off) and
  `AUTOTUNE_RESTART_COUNT` set.
- Zero-change (`--map` or `--preset` given): the script is tuned through its own flags (`zero_change.py`),
  or its plan comes from the cache (`script_cache.py`), then it runs with the winning flags; after an OOM
  it is re-tuned under a lower cap and restarted.

Either way the real run's optimizer steps are timed whole (`measure.py`), and its measured samples/s is
set beside the plan's claim (`claims.py`) and stored on the cached plan. A zero-change run's output lines
are read as they pass: a NaN or infinite loss the script prints is told once (`loss_lines.py`).

Every job runs in a process group of its own (`process.py`); SIGINT and SIGTERM are forwarded to it.
The supervisor opens the plan cache once, when it first needs it, and closes it when the run ends
(`script_cache.RunCache`).
`run` returns a `RunResult` whose `exit_code` is the README's: 0 success, the script's own code for a
failure that is not about memory (never retried), 3 when nothing fits or the restarts are spent, 5 when the
job ran but nothing was tuned (no `fit`, no `--map`), 128 + signal when interrupted, and 124 when a
zero-change trial outlived --trial-timeout. Settings errors raise `InvalidSetting` (exit 2), a missing GPU
`DeviceError` (exit 4), for the CLI to map.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import settings
from ..errors import InvalidSetting, NoFeasiblePlan
from ..plan import Plan
from ..search.progress import PROGRESS_ENV, progress_for
from ..settings import DEFAULT_MARGIN, DEFAULT_MEASURED_STEPS, ENV
from ..sizes import format_bytes, shorten
from ..techniques import parse_techniques
from ..workload.batching import per_rank_batch
from . import agent, claims
from .flags import FlagMap
from .launcher import Interrupted, Launcher
from .loss_lines import LossWatch
from .options import RunOptions
from .process import SignalForwarder
from .script_cache import RunCache, ScriptCache, script_parts
from .verdict import Verdict
from .zero_change import (
    THREADS_ENV,
    ScriptTrials,
    ScriptTuner,
    TrialFailed,
    compile_searched,
    job_threads,
    resolve_target,
    script_rungs,
)

log = logging.getLogger(__name__)

RESTART_COUNT_ENV = settings.RESTART_COUNT_ENV
EXIT_NO_FIT = 3
# The job ran but nothing was tuned: a cooperative script that never called autotune.fit, run without --map.
# Not 0, since `autotune run` did not do what it was asked (as pytest exits 5 when it collected no tests).
EXIT_NOTHING_TUNED = 5


@dataclass(frozen=True, kw_only=True, slots=True)
class Attempt:
    """One launch of the real run."""

    number: int  # 0 for the first launch, then the restart count
    micro_batch_size: int | None  # of the plan in force, when known
    outcome: str  # a verdict kind: ok, oom, error, interrupted
    exit_code: int
    seconds: float
    peak_gpu_bytes: int | None  # largest process of the job, per NVML
    note: str = ""


@dataclass(kw_only=True)
class RunResult:
    exit_code: int
    plan: Plan | None = None  # the plan in force at the end
    attempts: list[Attempt] = field(default_factory=list)
    message: str = ""  # why the run ended, when it did not succeed


def run(options: RunOptions, on_plan: Callable[[Plan], None] | None = None) -> RunResult:
    """Supervise `options.script` until it succeeds, fails for good, or is interrupted.

    Args:
        options: what to run and how.
        on_plan: called with a zero-change plan as soon as it is tuned (before the real run starts).

    Returns:
        The `RunResult`; its `exit_code` is what `autotune run` exits with.

    Raises:
        InvalidSetting: a setting is wrong. NoFeasiblePlan: nothing fits. DeviceError: no usable GPU.
    """
    forwarder = SignalForwarder()
    with forwarder.installed(), RunCache(options.cache) as cache:
        launcher = Launcher(options=options, forwarder=forwarder)
        try:
            if options.zero_change:
                return _zero_change(options, launcher, cache, on_plan)
            return _cooperative(options, launcher, cache)
        except Interrupted as exc:  # the plan in force goes with it: `--json` still prints what was tuned
            return RunResult(exit_code=128 + exc.signum, plan=launcher.plan,
                             message=f"interrupted by {signal.Signals(exc.signum).name}; the job was stopped")
        except TrialFailed as exc:
            return RunResult(exit_code=exc.exit_code, message=str(exc))
        finally:
            launcher.close()


# -- cooperative mode -----------------------------------------------------------------------------------

def _cooperative_env(opts: RunOptions) -> dict[str, str]:
    """The run's options as the `AUTOTUNE_*` variables `fit` reads; options not given are left out."""
    given = {"global_batch_size": opts.global_batch_size, "memory_budget": opts.budget, "margin": opts.margin,
             "host_memory_budget": opts.host_budget, "max_length": opts.max_length,
             "device": opts.device, "cache": opts.cache, "measured_steps": opts.trial_steps}
    env = {ENV[name]: str(value) for name, value in given.items() if value is not None}
    if opts.tune_only:
        env[agent.TUNE_ONLY_ENV] = "1"
    if opts.retune:
        env[ENV["retune"]] = "1"
    if opts.progress and sys.stderr.isatty():  # the job's stderr is our pipe, echoed to this terminal
        env[PROGRESS_ENV] = "live"
    return env


def _cooperative(opts: RunOptions, launcher: Launcher, cache: RunCache) -> RunResult:
    base = _cooperative_env(opts)
    attempts: list[Attempt] = []
    cap: int | None = None
    plan: Plan | None = None
    # The job's own key: its plan's, from a launch without our micro-batch cap. The cap is part of the key
    # (cache/key.py), so a restart's plan has a key of its own, which the next launch without the cap never
    # reads: every failure goes against the job's key, where that launch's `fit` finds it.
    job_key = ""
    for number in range(opts.max_restarts + 1):
        env = {**base, RESTART_COUNT_ENV: str(number)}
        if cap is not None:
            # Retune: a plan cached before the failure must not come back; the cap keeps the next one
            # smaller even when the cache is off or could not record the failure.
            env.update({ENV["max_micro_batch"]: str(cap), ENV["retune"]: "1"})
        verdict = launcher.launch(list(opts.script_args), env)
        plan = verdict.plan or plan
        _warn_if_ranks_alone(opts, verdict.plan)
        attempts.append(_attempt(number, verdict, verdict.plan))
        if verdict.kind == "ok" and plan is None and verdict.autotune_error is None:
            return _nothing_tuned(opts, verdict, attempts)
        if verdict.kind != "oom":
            if verdict.plan is not None:
                plan = _record_run(cache, claims.judge(verdict.plan, verdict.records))
            return _finish(verdict, plan, attempts)
        if verdict.host_memory:
            base = _lower_host_budget(base, verdict, number, opts.max_restarts)
            continue
        failed = verdict.plan
        if failed is not None and cap is None:
            job_key = failed.key
        if failed is None:
            return RunResult(exit_code=EXIT_NO_FIT, plan=plan, attempts=attempts, message=(
                f"the script ran out of memory ({verdict.note}) before autotune.fit reported a plan, so autotune "
                "cannot choose a smaller one. If the script takes its batch size as flags, run it in zero-change "
                "mode: --map micro_batch=FLAG --map accumulation=FLAG."))
        _record_failure(cache, job_key, failed, verdict.note, number)
        cap = failed.micro_batch_size - 1
        if cap < 1:
            return RunResult(exit_code=EXIT_NO_FIT, plan=plan, attempts=attempts, message=(
                f"the real run ran out of memory at micro-batch 1 ({failed.rung.name}): nothing smaller to try. "
                "Raise --budget, allow more techniques (AUTOTUNE_TECHNIQUES), or shrink the model or sequence."))
        if number < opts.max_restarts:
            log.warning("attempt %d ran out of memory at micro-batch %d (%s); restarting (%d of %d) with "
                        "micro-batch at most %d", number + 1, failed.micro_batch_size, verdict.note, number + 1,
                        opts.max_restarts, cap)
    return _spent(opts, plan, attempts)


HOST_BACKOFF = 0.8  # a job killed for host memory is restarted with a host budget this far below what it reached


def _lower_host_budget(env: dict[str, str], verdict: Verdict, number: int, restarts: int) -> dict[str, str]:
    """The job's environment for a restart after a kill for host memory: a host budget under what it reached,
    and a retune (a cached plan made under more host room must not come back)."""
    reached = verdict.exit.peak_host_bytes or 0
    budget = max(1, int(HOST_BACKOFF * reached))
    if number < restarts:
        log.warning("attempt %d was %s; restarting (%d of %d) with a host budget of %s", number + 1, verdict.note,
                    number + 1, restarts, format_bytes(budget))
    return {**env, ENV["host_memory_budget"]: str(budget), ENV["retune"]: "1"}


def _warn_if_ranks_alone(opts: RunOptions, plan: Plan | None) -> None:
    """Several processes whose fit saw one rank never initialised torch.distributed: each trained alone."""
    if opts.world_size > 1 and plan is not None and plan.world_size == 1:
        log.warning("the job ran %d processes (--nproc-per-node), but its fit saw a world of 1: the script never "
                    "initialised torch.distributed, so each rank tuned and trained alone on the whole global "
                    "batch of %d, with no gradient averaging. Call torch.distributed.init_process_group() before "
                    "autotune.fit, or drop --nproc-per-node", opts.world_size, plan.global_batch_size)


def _record_failure(cache: RunCache, key: str, plan: Plan, note: str, number: int) -> None:
    """Record under `key` (the job's own) that `plan`'s micro-batch ran out of memory, so the job's next `fit`
    starts below it; never fails the run."""
    store = cache.store() if key else None
    if store is None:
        return
    store.mark_unsafe(key, micro_batch_size=plan.micro_batch_size,
                      note=shorten(f"OOM in the real run (autotune run, attempt {number + 1}): {note}", 500))
    log.info("recorded the OOM at micro-batch %d against plan %s in the cache", plan.micro_batch_size, key[:12])


def _record_run(cache: RunCache, plan: Plan) -> Plan:
    """Store what the run measured on `fit`'s cached plan (`autotune cache show` lists it); returns `plan`."""
    store = cache.store() if plan.key and plan.measured_samples_per_second is not None else None
    if store is not None:
        store.replace(plan.key, plan)
    return plan


# -- zero-change mode -----------------------------------------------------------------------------------

def _zero_change(opts: RunOptions, launcher: Launcher, run_cache: RunCache,
                 on_plan: Callable[[Plan], None] | None) -> RunResult:
    tuner, cache = _tuner(opts, launcher, run_cache)
    plan = cache.first_plan(tuner, retune=opts.retune)
    launcher.close()  # the real run starts fresh, with the fork server's memory given back
    if on_plan is not None:
        on_plan(plan)
    if opts.tune_only:
        return RunResult(exit_code=0, plan=plan)
    env = {k: v for k, v in tuner.trials.env.items() if k != agent.STEPS_ENV}
    attempts: list[Attempt] = []
    for number in range(opts.max_restarts + 1):
        args = tuner.arguments(plan)
        log.info("running: %s", shlex.join([opts.script, *args]))
        launcher.plan, launcher.on_line = plan, LossWatch(plan)
        verdict = launcher.launch(args, {**env, RESTART_COUNT_ENV: str(number)})
        attempts.append(_attempt(number, verdict, plan))
        if verdict.kind != "oom":
            plan = claims.judge(plan, verdict.records)
            if plan.measured_samples_per_second is not None:
                cache.record_run(plan)
            return _finish(verdict, plan, attempts)
        cache.record_oom(plan, verdict.note, number)
        if plan.micro_batch_size == 1:
            return RunResult(exit_code=EXIT_NO_FIT, plan=plan, attempts=attempts, message=(
                f"the real run ran out of memory at micro-batch 1 ({verdict.note}): nothing smaller to try"))
        if number == opts.max_restarts:
            break
        try:
            smaller = cache.save(tuner.tune(max_micro=plan.micro_batch_size - 1))
        except NoFeasiblePlan as exc:
            return RunResult(exit_code=EXIT_NO_FIT, plan=plan, attempts=attempts, message=str(exc))
        log.warning("the real run ran out of memory at micro-batch %d (%s); restarting (%d of %d) with %s",
                    plan.micro_batch_size, verdict.note, number + 1, opts.max_restarts, smaller.summary())
        plan = smaller
    return _spent(opts, plan, attempts)


def _tuner(opts: RunOptions, launcher: Launcher, cache: RunCache) -> tuple[ScriptTuner, ScriptCache]:
    flags = FlagMap.parse(opts.maps, opts.preset)
    world = opts.world_size
    global_batch = opts.global_batch_size or flags.global_batch(opts.script_args, world)
    if global_batch is None:
        raise InvalidSetting(
            f"zero-change mode needs the global batch: pass --global-batch-size, or give the script its own "
            f"{flags.micro_batch} and {flags.accumulation} (their product x ranks is the global batch)")
    per_rank = per_rank_batch(global_batch, world)
    target = resolve_target(opts.device, opts.budget)
    margin = DEFAULT_MARGIN if opts.margin is None else opts.margin
    allowed = parse_techniques(settings.read(ENV["techniques"]) or None)
    rungs, notes = script_rungs(flags, allowed, target.bf16_off)
    compiled, note = compile_searched(flags, allowed, target)
    notes += [note] if note else []
    env = {agent.DEVICE_ENV: target.kind, **job_threads(target, os.environ)}
    if target.apply_budget:
        env[agent.BUDGET_ENV] = str(target.budget_bytes)
    if target.kind == "cpu":
        log.info("no GPU in use: trials run on the CPU under a simulated memory ceiling of %s%s%s",
                 format_bytes(target.budget_bytes), "" if opts.budget else " (the host memory available; pass "
                 "--budget to simulate a GPU's)", ", one intra-op thread (OMP_NUM_THREADS=1)" if env.get(
                     THREADS_ENV) else "")
    log.info("zero-change tuning of %s: global batch %d over %d rank(s), micro-batches dividing %d, budget %s",
             os.path.basename(opts.script), global_batch, world, per_rank, format_bytes(target.budget_bytes))
    trials = ScriptTrials(launch=lambda args, extra: launcher.launch(args, extra, trial=True), flags=flags,
                          script_args=opts.script_args, per_rank=per_rank, world_size=world,
                          limit_bytes=int((1 - margin) * target.budget_bytes),
                          trial_steps=opts.trial_steps or DEFAULT_MEASURED_STEPS, env=env,
                          forked=lambda: launcher.forked)
    tuner = ScriptTuner(trials=trials, rungs=rungs, notes=notes, global_batch_size=global_batch,
                        budget_bytes=target.budget_bytes, margin=margin, device=target.kind, device_name=target.name,
                        compile=compiled, progress=progress_for(None) if opts.progress else None)
    parts = script_parts(script=opts.script, script_args=opts.script_args, flags=flags, global_batch_size=global_batch,
                         world_size=world, device_kind=target.kind, device_name=target.name,
                         total_bytes=target.total_bytes, budget_bytes=target.budget_bytes, margin=margin,
                         techniques=allowed,
                         host_budget_bytes=opts.host_budget_bytes)
    return tuner, ScriptCache(cache.store(), parts)


# -- endings --------------------------------------------------------------------------------------------

def _attempt(number: int, verdict: Verdict, plan: Plan | None) -> Attempt:
    return Attempt(number=number, micro_batch_size=plan.micro_batch_size if plan else None, outcome=verdict.kind,
                   exit_code=verdict.exit_code, seconds=verdict.exit.seconds,
                   peak_gpu_bytes=verdict.exit.peak_gpu_bytes, note=verdict.note)


def _finish(verdict: Verdict, plan: Plan | None, attempts: list[Attempt]) -> RunResult:
    """The run ends with this job's own outcome: success, autotune's own error (exit 2, 3 or 4, with its
    message), or a failure of the script that is not about memory (its own exit code; 137 for a SIGKILL that
    neither the kernel's OOM killer nor exhausted host memory explains)."""
    if verdict.autotune_error is not None:
        return RunResult(exit_code=verdict.exit_code, plan=plan, attempts=attempts,
                         message=f"error: {verdict.autotune_error}")
    if verdict.kind == "ok":
        message = ""
    elif verdict.exit.returncode == -signal.SIGKILL:  # a kill from elsewhere: the job's plan is not at fault
        message = (f"the job was {verdict.note}: exit {verdict.exit_code}, not restarted, and nothing recorded "
                   "against the plan")
    else:
        message = f"the script failed ({verdict.note}); not an out-of-memory error, so it is not retried"
    return RunResult(exit_code=verdict.exit_code, plan=plan, attempts=attempts, message=message)


def _nothing_tuned(opts: RunOptions, verdict: Verdict, attempts: list[Attempt]) -> RunResult:
    name = os.path.basename(opts.script)  # the command line prints the message once; no log line repeats it
    return RunResult(exit_code=EXIT_NOTHING_TUNED, attempts=attempts, message=(
        f"nothing was tuned (exit {EXIT_NOTHING_TUNED}): {name} ran to the end (exit {verdict.exit_code}) without "
        "calling autotune.fit. Call autotune.fit(model, batch) in the script (cooperative mode), or name the "
        "flags that carry its batch size with --map micro_batch=FLAG --map accumulation=FLAG (zero-change mode)."))


def _spent(opts: RunOptions, plan: Plan | None, attempts: list[Attempt]) -> RunResult:
    history = "; ".join(f"attempt {a.number + 1}: micro-batch {a.micro_batch_size or '?'} {a.outcome}"
                        for a in attempts)
    return RunResult(exit_code=EXIT_NO_FIT, plan=plan, attempts=attempts, message=(
        f"still out of memory after {opts.max_restarts} restart(s) ({history}); raise --max-restarts or "
        "--budget, or lower the load"))
