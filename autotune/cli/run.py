"""`autotune run [OPTIONS] SCRIPT [SCRIPT_ARGS]...`: wrap an existing training script.

See `autotune.supervisor.runner`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from ..cache.rows import printable
from ..errors import DeviceError, InvalidSetting, NoFeasiblePlan
from ..evidence import Trial
from ..plan import Plan
from ..plotting import PlotUnavailable, draw_search, require_matplotlib
from ..sizes import format_bytes, shorten
from ..supervisor.agent import configure_logging
from ..supervisor.flags import PRESETS
from ..supervisor.options import DEFAULT_GRACE, DEFAULT_MAX_RESTARTS, DEFAULT_TRIAL_TIMEOUT, RunOptions
from ..supervisor.runner import Attempt, RunResult
from ..supervisor.runner import run as run_script
from ..workload.batching import check_global_batch_size

EXAMPLES = """\b
Examples:
  # cooperative: the script calls autotune.fit(model, batch)
  autotune run --global-batch-size 64 --budget 24GiB train.py --epochs 3
  # zero-change: the script takes its batch size and accumulation as flags
  autotune run --global-batch-size 64 \\
      --map micro_batch=--per_device_train_batch_size \\
      --map accumulation=--gradient_accumulation_steps \\
      --map checkpointing=--gradient_checkpointing --map bf16=--bf16 \\
      train_hf.py --output_dir out
  # two GPUs through torch.distributed.run; print the plan as JSON
  autotune run --nproc-per-node 2 --json train.py
  # a switch that takes a value: a value template after the flag
  autotune run --global-batch-size 64 --map micro_batch=--batch_size \\
      --map accumulation=--accumulate --map bf16=--precision=bf16-mixed train_lightning.py
"""


def _presets_help() -> str:
    """The presets, each with its maps and an example, for the epilog of `autotune run --help`."""
    lines = ["\b", "Presets (--preset NAME; a --map beside one overrides its entry for that knob):"]
    for name, preset in PRESETS.items():
        lines += [f"  {name}: {preset.about}", f"    maps {' '.join(preset.maps)}", f"    e.g. {preset.example}"]
    return "\n".join(lines) + "\n"


class UsageLine(click.ClickException):
    """A usage error, shown as one line ("autotune: error: ...") with exit code 2: no usage block, no traceback."""

    exit_code = 2

    def show(self, file: object = None) -> None:
        click.echo(f"autotune: error: {self.format_message()}", err=True)


class _RunCommand(click.Command):
    """`autotune run`, whose option errors (a number out of range, a missing script) are one `UsageLine`."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: object) -> click.Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            raise UsageLine(exc.format_message()) from None


class _Finite(click.FloatRange):
    """A float option that refuses NaN and infinity, which no count of seconds or fraction can be."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number; pass a plain number (autotune run --help says which)",
                      param, ctx)
        return super().convert(number, param, ctx)  # then the range


@click.command(cls=_RunCommand, context_settings={"allow_interspersed_args": False},
               epilog=EXAMPLES + "\n" + _presets_help())
@click.option("--global-batch-size", type=click.IntRange(min=1), help="Samples per optimizer step over all ranks.")
@click.option("--budget", metavar="SIZE", help="Memory budget per GPU, e.g. 24GiB (default: free memory; "
              "on the CPU the simulated ceiling).")
@click.option("--max-length", type=click.IntRange(min=1), help="The longest sequence training will see, in tokens "
              "(default: the example batch's); the trials run at it.")
@click.option("--host-budget", metavar="SIZE", help="Host memory the plan may use, e.g. 96GiB: optimizer offload's "
              "masters, moments and pinned buffers (default: available memory, capped by a cgroup limit, less 10%).")
@click.option("--cache", metavar="PATH", help="Plan cache file, or 'off' (default: $AUTOTUNE_CACHE, else the user "
              "cache).")
@click.option("--margin", type=_Finite(min=0, max=0.9, max_open=True),
              help="Fraction of the budget kept free (default 0.1).")
@click.option("--max-restarts", type=click.IntRange(min=0), default=DEFAULT_MAX_RESTARTS, show_default=True,
              help="Restarts after an out-of-memory death before giving up (exit 3).")
@click.option("--trial-steps", type=click.IntRange(min=1), help="Measured optimizer steps per trial, after one "
              "warm-up step (default 3).")
@click.option("--trial-timeout", type=_Finite(min=0, min_open=True), default=DEFAULT_TRIAL_TIMEOUT,
              show_default=True, help="Seconds a zero-change trial may take before it is stopped (exit 124).")
@click.option("--grace-period", type=_Finite(min=0), default=DEFAULT_GRACE, show_default=True,
              help="Seconds between forwarding SIGINT/SIGTERM to the job and killing it.")
@click.option("--tune-only", is_flag=True, help="Stop once the plan is chosen; do not train.")
@click.option("--retune", is_flag=True, help="Tune again even when the plan cache holds a plan for this job.")
@click.option("--json", "json_output", is_flag=True, help="Print the plan as JSON on stdout (the job's own "
              "stdout goes to stderr).")
@click.option("--nproc-per-node", type=click.IntRange(min=1), help="Launch through torch.distributed.run with "
              "this many processes.")
@click.option("--map", "maps", multiple=True, metavar="KNOB=FLAG[=VALUE]", help="Zero-change mode: the script "
              "flag carrying a knob: micro_batch, accumulation, checkpointing, bf16 or compile. The switches "
              "(checkpointing, bf16, compile) are FLAG alone when on, or FLAG=VALUE with a value template, e.g. "
              "bf16=--trainer.precision=bf16-mixed. Repeatable.")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), help="Zero-change mode with the flags of a known "
              "launcher (listed below); --map entries beside it override the preset's.")
@click.option("--device", help="'cuda' or 'cpu' (default: cuda when a GPU is visible, else the CPU under a "
              "simulated ceiling).")
@click.option("-v", "--verbose", count=True, help="More detail (-v also shows the trials' own output).")
@click.option("-q", "--quiet", count=True, help="Less detail: no progress lines.")
@click.option("--plot", "plot_path", metavar="FILE.png", type=click.Path(dir_okay=False, path_type=Path),
              help="Draw the search (throughput and peak memory per configuration tried) to this image once the "
              "plan is known; needs matplotlib: pip install matplotlib.")
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def run(script: str, script_args: tuple[str, ...], verbose: int, quiet: int, json_output: bool,
        plot_path: Path | None, **options: object) -> None:
    """Wrap an existing training script: tune, launch, watch, and restart it after an out-of-memory death.

    Everything after SCRIPT goes to the script untouched. A script that calls autotune.fit gets the
    options as AUTOTUNE_* environment variables (cooperative mode); a script that knows nothing of
    autotune is tuned through its own flags with --map (zero-change mode). Exit codes: 0 success, the
    script's own code when it fails for a reason other than memory, 2 usage error, 3 nothing fits or
    restarts spent, 4 no usable GPU, 5 the script ran but nothing was tuned (it never called
    autotune.fit and no --map was given), 124 a trial timed out, 130/143 interrupted.
    """
    _configure_logging(verbose, quiet)
    picture = _Picture(plot_path, os.path.basename(script)) if plot_path else None
    if picture is not None:
        try:
            require_matplotlib()  # before any tuning: a missing extra must not cost a whole search
        except PlotUnavailable as exc:
            _fail(f"--plot: {exc}", 4)
    try:
        if options["global_batch_size"] is not None:
            check_global_batch_size(options["global_batch_size"], "--global-batch-size")
        # The remaining options are named as RunOptions' fields.
        opts = RunOptions(script=script, script_args=script_args, json_output=json_output, verbose=verbose > 0,
                          progress=quiet == 0, **options)  # type: ignore[arg-type]
        result = run_script(opts, on_plan=lambda plan: _on_plan(plan, json_output, picture))
    except InvalidSetting as exc:
        raise UsageLine(str(exc)) from exc
    except NoFeasiblePlan as exc:
        if not json_output:
            click.echo(format_trials(exc.trials), err=True)
        _fail(str(exc), 3)
    except DeviceError as exc:
        _fail(str(exc), 4)
    _report(result, json_output, cooperative=not opts.zero_change)
    if picture is not None and result.plan is not None:
        picture(result.plan)  # a cooperative job's plan arrives with its end; a re-tuned one replaces the first
    sys.exit(result.exit_code)


def _configure_logging(verbose: int, quiet: int) -> None:
    """Progress lines on stderr: INFO by default, DEBUG with -v, WARNING with -q, ERROR with -qq.

    For this command only: the logger is put back when it ends (exit codes included), so an in-process
    caller's logging is as it was.
    """
    restore = configure_logging(logging.DEBUG if verbose else (logging.INFO, logging.WARNING,
                                                                logging.ERROR)[min(quiet, 2)])
    click.get_current_context().call_on_close(restore)


def _fail(message: str, code: int) -> None:
    click.echo(f"autotune: error: {message}", err=True)
    sys.exit(code)


def _on_plan(plan: Plan, json_output: bool, picture: _Picture | None) -> None:
    """A zero-change plan, as soon as it is tuned (before the real run)."""
    if not json_output:
        _show_plan(plan)
    if picture is not None:
        picture(plan)


class _Picture:
    """Draws each new plan's search to one file; a drawing that fails warns and never fails the run."""

    def __init__(self, path: Path, script: str) -> None:
        self.path = path
        self.script = script
        self.drawn: Plan | None = None

    def __call__(self, plan: Plan) -> None:
        if plan == self.drawn:
            return
        try:
            draw_search(plan, self.path, title=self.script)
        except (ValueError, OSError) as exc:
            click.echo(f"autotune: --plot: could not draw the search to {self.path}: {exc}", err=True)
            return
        self.drawn = plan
        click.echo(f"autotune: drew the search ({len(plan.trials)} trials) to {self.path}", err=True)


def _show_plan(plan: Plan) -> None:
    if plan.source != "cache":  # a cached plan's trials ran in an earlier launch: the plan line says so
        click.echo(format_trials(plan.trials, plan), err=True)
    click.echo(format_plan(plan), err=True)


def _report(result: RunResult, json_output: bool, *, cooperative: bool) -> None:
    if json_output:
        click.echo(json.dumps(result.plan.to_dict() if result.plan else None, indent=2))
    elif cooperative and result.plan is not None:
        _show_plan(result.plan)  # zero-change plans were shown before the real run
    if len(result.attempts) > 1 and not json_output:
        click.echo(format_attempts(result.attempts), err=True)
    if result.message:
        click.echo(f"autotune: {result.message}", err=True)


# -- tables ---------------------------------------------------------------------------------------------

def format_trials(trials: Sequence[Trial], plan: Plan | None = None) -> str:
    """What was tried: one row per trial; an MFU column when `plan` knows its GPU's peak."""
    mfu = plan is not None and plan.mfu is not None
    rows = [f"{'#':>3}  {'rung':<26} {'micro':>5}  {'outcome':<11} {'peak':>10} {'samples/s':>10}"
            + (f" {'MFU':>6}" if mfu else "") + "  note"]
    for i, t in enumerate(trials, 1):
        rate = f"{t.samples_per_second:,.1f}" if t.outcome != "oom" else "-"
        row = (f"{i:>3}  {t.rung.name:<26} {t.micro_batch_size:>5}  {t.outcome:<11} "
               f"{format_bytes(t.peak_bytes) if t.peak_bytes else '-':>10} {rate:>10}")
        if plan is not None and mfu:
            share = plan.trial_mfu(t)
            row += f" {f'{share:.1%}' if share is not None else '-':>6}"
        rows.append(printable(f"{row}  {shorten(t.note, 70)}"))  # a cached refusal's trials may be a teammate's
    return "\n".join(rows)


def format_plan(plan: Plan) -> str:
    """The chosen plan and why, in two lines; a cached plan names its key and how to tune again."""
    if plan.source == "cache":
        return (f"plan (cached): {plan.summary()}\nwhy: {plan.reason}\n"
                f"from an earlier tune, cache key {plan.key[:12]}; --retune tunes again")
    return f"plan ({plan.source}): {plan.summary()}\nwhy: {plan.reason}"


def format_attempts(attempts: Sequence[Attempt]) -> str:
    rows = [f"{'attempt':>7}  {'micro':>5}  {'outcome':<11} {'exit':>4} {'seconds':>8} {'GPU peak':>10}  note"]
    for a in attempts:
        peak = format_bytes(a.peak_gpu_bytes) if a.peak_gpu_bytes else "-"
        rows.append(f"{a.number + 1:>7}  {a.micro_batch_size or '?':>5}  {a.outcome:<11} {a.exit_code:>4} "
                    f"{a.seconds:>8.1f} {peak:>10}  {shorten(a.note, 70)}")
    return "\n".join(rows)
