"""The in-process side of `autotune run`: what runs inside the job, and the result file it leaves.

`autotune run` starts every job as `python -m autotune.supervisor.bootstrap SCRIPT ARGS...`, which calls `main`
here: it runs the script with `runpy` as `__main__`, and on the way out (normal end, exception,
`sys.exit`) records in the result file ($AUTOTUNE_RESULT_FILE) how it ended, classified with `is_oom`
while the exception object still exists. `fit` adds the plan in force with `report_plan`.

Every job's optimizer steps are counted and timed whole with global optimizer step hooks (`measure.py`),
from the second step on (the first builds the optimizer state). A zero-change trial
($AUTOTUNE_AGENT_STEPS set) reads the peak memory, writes the measurements and exits after that many
steps; a real run records its median whole step when it ends (`measured`), for the supervisor to set
beside the plan's claimed throughput. A plan reported by `fit` restarts the count: fit's own trials
stepped optimizers too.
With $AUTOTUNE_AGENT_BUDGET it applies a memory ceiling first: on CUDA through
`torch.cuda.set_per_process_memory_fraction`, on the CPU through the simulated ceiling.

Under torchrun every rank writes its own file (`<path>.rank<N>` for ranks above 0).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import runpy
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from .. import api, settings
from ..cache.store import CacheWarning
from ..plan import Plan
from ..sizes import format_bytes
from ..techniques.optimizer_8bit import quiet_import_noise
from .measure import PeakMeter, StepWatch, clock

log = logging.getLogger(__name__)

RESULT_FILE_ENV = settings.RESULT_FILE_ENV
STEPS_ENV = settings.AGENT_STEPS_ENV  # zero-change trial: stop after this many optimizer steps
BUDGET_ENV = settings.AGENT_BUDGET_ENV  # bytes: apply a memory ceiling to the whole script
DEVICE_ENV = settings.AGENT_DEVICE_ENV  # "cuda" or "cpu": which kind of ceiling, and what to measure
TUNE_ONLY_ENV = settings.TUNE_ONLY_ENV  # "1": exit as soon as fit reports its plan
LOG_LEVEL_ENV = settings.LOG_LEVEL_ENV  # the supervisor's verbosity, for autotune's logger in the job

TRACEBACK_CHARS = 4000


# -- the result file ----------------------------------------------------------------------------------

def result_path() -> str | None:
    """This process's result file: $AUTOTUNE_RESULT_FILE for rank 0, with `.rank<N>` for the others."""
    base = settings.result_file()
    if not base:
        return None
    rank = int(os.environ.get("RANK", "0") or 0)
    return base if rank == 0 else f"{base}.rank{rank}"


def update_result(**fields: Any) -> None:
    """Merge `fields` into this process's result file, atomically (write a temporary file, then rename)."""
    path = result_path()
    if path is None:
        return
    record = _read(path) or {}
    record.update(fields)
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".result-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError as exc:  # the supervisor is gone, or its directory: never mask the job's own outcome
        log.warning("could not write the result file %s: %s", path, exc)


def read_results(base: str) -> list[dict[str, Any]]:
    """Every rank's record for result file `base` (the supervisor's side); rank 0 first."""
    paths = [base, *sorted(glob.glob(glob.escape(base) + ".rank*"))]
    return [r for r in (_read(p) for p in paths) if r is not None]


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable result file %s: %s", path, exc)
        return None
    return record if isinstance(record, dict) else None


def report_plan(plan: Plan) -> None:
    """Record `plan` as the plan in force, so `autotune run` knows what failed if the job runs out of memory.

    Under `autotune run --tune-only` the job ends here, successfully, once the plan is recorded.
    """
    if result_path() is None:
        return
    update_result(plan=plan.to_dict())
    if _watch is not None:
        _watch.restart()  # what counts is the plan's training, not fit's trials before it
    if settings.read(TUNE_ONLY_ENV) == "1":
        log.info("autotune run --tune-only: plan recorded, stopping the script")
        _exit_now(0)


def _exit_now(code: int) -> None:
    """Leave at once, without the script's own teardown (checkpoint saving, worker shutdown)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# -- how the script ended -----------------------------------------------------------------------------

def describe_exception(exc: BaseException) -> dict[str, Any]:
    """The record of a failure: OOM or not (anywhere in the exception chain), its first line, the traceback tail."""
    from ..errors import is_oom

    chain = _chain(exc)
    oom = next((e for e in chain if is_oom(e)), None)
    shown = oom or exc
    lines = str(shown).strip().splitlines()
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"outcome": "oom" if oom is not None else "error",
            "error": f"{type(shown).__name__}: {lines[0] if lines else ''}"[:500],
            "traceback": text[-TRACEBACK_CHARS:]}


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return seen


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


# -- watching optimizer steps (measure.py) ------------------------------------------------------------

_watch: StepWatch | None = None  # this job's step watch, once main installed it


def _trial_watch(stop_after: int, meter: PeakMeter, now: Callable[[], float]) -> StepWatch:
    """A zero-change trial's watch: peak memory from the second step on, and the process ends after
    `stop_after` steps with the measurements in the result file."""

    def on_step(watch: StepWatch) -> None:
        if watch.count == 1:
            meter.reset()  # peak from the second step on: optimizer state exists from here
        if watch.count >= stop_after:
            peak, retries = meter.read()
            update_result(outcome="ok", exit_code=0, steps=watch.count, trial=watch.trial_record(peak, retries))
            _exit_now(0)

    return StepWatch(on_step, now)


@contextlib.contextmanager
def memory_ceiling(device: str, budget: int | None) -> Iterator[Any]:
    """Apply `budget` bytes as the job's memory ceiling; yields the simulated ceiling on the CPU, else None."""
    if budget is None:
        yield None
        return
    if device == "cpu":
        from ..devices.ceiling import SimulatedCeiling

        ceiling = SimulatedCeiling(budget)
        with ceiling:
            yield ceiling
        return
    import torch

    index = int(os.environ.get("LOCAL_RANK", "0") or 0)
    index = index if index < torch.cuda.device_count() else 0
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), index)
    log.info("memory ceiling %s of %s on cuda:%d", format_bytes(budget), format_bytes(total), index)
    yield None


# -- the entry point ----------------------------------------------------------------------------------

def main(argv: list[str]) -> None:
    """Run `argv[0]` as `__main__` with `argv[1:]` as its arguments, recording how it ends."""
    if not argv:
        raise SystemExit("usage: python -m autotune.supervisor.bootstrap SCRIPT [ARGS...]")
    if settings.read(LOG_LEVEL_ENV):
        configure_logging(settings.read(LOG_LEVEL_ENV))
    plain_cache_warnings()
    quiet_import_noise()
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` would have it
    budget = int(settings.read(BUDGET_ENV)) if settings.read(BUDGET_ENV) else None
    steps = int(settings.read(STEPS_ENV) or 0)
    global _watch
    try:
        device = settings.read(DEVICE_ENV, "cuda")
        with memory_ceiling(device, budget) as ceiling:
            if result_path() is not None:
                api.on_plan(report_plan)  # fit reports the plan it returns
                now = clock(device)
                _watch = _trial_watch(steps, PeakMeter(ceiling), now) if steps else StepWatch(now=now)
                _watch.install()
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
        _update_ended(outcome="ok" if code == 0 else "error", exit_code=code)
        raise
    except KeyboardInterrupt:
        _update_ended(outcome="interrupted", exit_code=130)
        raise
    except Exception as exc:  # autotune's own errors become exit codes; the rest re-raised
        own_code = autotune_exit_code(exc)
        if own_code is None:
            _update_ended(exit_code=1, **describe_exception(exc))
            raise
        # What fit (or a training step) raised on purpose: its message says what to do, and a traceback of
        # autotune's internals would bury it. The supervisor prints the message; without one, we do.
        _update_ended(outcome="error", exit_code=own_code, error=f"{type(exc).__name__}: {exc}"[:500],
                      autotune_error={"type": type(exc).__name__, "message": str(exc)})
        if result_path() is None:
            sys.stderr.write(f"autotune: error: {exc}\n")
        raise SystemExit(own_code) from None
    except BaseException as exc:  # recorded, then re-raised untouched
        _update_ended(exit_code=1, **describe_exception(exc))
        raise
    _update_ended(outcome="ok", exit_code=0)


def _update_ended(**fields: Any) -> None:
    """Record how the job ended, with its optimizer steps and, when it made two or more, their timing."""
    measured = _watch.run_record() if _watch is not None else None
    update_result(steps=_watch.count if _watch is not None else None, **fields,
                  **({"measured": measured} if measured else {}))


def autotune_exit_code(exc: BaseException) -> int | None:
    """The exit code `autotune run` gives an error autotune raised on purpose; None for any other error.

    NoFeasiblePlan 3 (nothing fits), DeviceError 4 (environment: no GPU, a poisoned context), InvalidSetting
    2 (usage). Checked before the OOM classifier: a NoFeasiblePlan chained to the last trial's OOM is not
    an OOM to restart after.
    """
    from ..errors import DeviceError, InvalidSetting, NoFeasiblePlan

    for kind, code in ((NoFeasiblePlan, 3), (DeviceError, 4), (InvalidSetting, 2)):
        if isinstance(exc, kind):
            return code
    return None


def configure_logging(level: int | str) -> Callable[[], None]:
    """Send autotune's own logger (never the root logger) to stderr at `level`, as "autotune: ..." lines.

    Used by the CLI and, at the CLI's verbosity, inside the jobs it starts. Returns a function that puts
    the logger back as it was: a command invoked in-process (click's test runner, a notebook) must not
    leave the logger at its level, detached from the root logger and writing to a stream since closed.
    """
    logger = logging.getLogger("autotune")
    before = (logger.handlers[:], logger.level, logger.propagate)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Prefixed())
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # a script that configures the root logger would print each line twice

    def restore() -> None:
        logger.handlers[:], logger.propagate = before[0], before[2]
        logger.setLevel(before[1])

    return restore


def plain_cache_warnings() -> Callable[[], None]:
    """Show the plan cache's warnings as one "autotune: warning: ..." line on stderr, not in Python's warning
    format with a source line; other warnings as before. Returns the function that puts the old display back.

    Used by the CLI and inside the jobs it starts, where `fit` opens the cache.
    """
    before = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        if issubclass(category, CacheWarning):
            (file or sys.stderr).write(f"autotune: warning: {message}\n")
        else:
            before(message, category, filename, lineno, file, line)

    def restore(*_: Any) -> None:
        warnings.showwarning = before

    warnings.showwarning = show
    return restore


class _Prefixed(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if text.startswith("autotune") else f"autotune: {text}"
