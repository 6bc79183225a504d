"""`Launcher`: starts the script of `autotune run` through the agent (and torchrun when asked), one job at a
time, and classifies how each job ended (`verdict.py`)."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from .. import settings
from ..devices import allocator
from ..errors import DeviceError
from ..plan import Plan
from ..sizes import format_bytes
from . import agent
from .forkserver import ForkServer, ForkServerError
from .options import RunOptions
from .process import Child, SignalForwarder, Started
from .verdict import Verdict, classify

log = logging.getLogger("autotune.supervisor.runner")  # the run's log, as before the launcher had its own module


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum


@dataclass(kw_only=True)
class Launcher:
    """Starts the script through the agent (and torchrun when asked), one job at a time."""

    options: RunOptions
    forwarder: SignalForwarder
    plan: Plan | None = None  # the plan in force: set before a zero-change run, reported by a cooperative job
    forks: ForkServer | None = None  # forks zero-change trials once started; None before, or where it cannot
    forks_off: str = ""  # why trials start as fresh processes, once that is decided
    forked: str = ""  # what the trials forked from, once they did (ForkServer.describe)
    on_line: Callable[[str], None] | None = None  # reads each line a real run writes (`process.Child`)

    def command(self, args: list[str]) -> list[str]:
        opts = self.options
        entry = ["-m", "autotune.supervisor.bootstrap", opts.script, *args]
        if opts.nproc_per_node is None:
            return [sys.executable, *entry]
        if importlib.util.find_spec("torch.distributed.run") is None:
            raise DeviceError("--nproc-per-node needs torch.distributed.run, which this torch build lacks")
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={opts.nproc_per_node}", *entry]

    def launch(self, args: list[str], env: dict[str, str], *, trial: bool = False) -> Verdict:
        """Run the job once and classify how it ended; raises `Interrupted` if we were signalled."""
        opts = self.options
        if self.forwarder.received is not None:  # signalled between two jobs: start no other
            raise Interrupted(self.forwarder.received)
        with tempfile.TemporaryDirectory(prefix="autotune-run-") as tmp:
            result_file = os.path.join(tmp, "result.json")
            child = Child(self.command(args), env=self._environment(env, result_file),
                          echo=not trial or opts.verbose, capture_stdout=trial, stdout_to_stderr=opts.json_output,
                          timeout=opts.trial_timeout if trial else None, grace=opts.grace_period,
                          name=os.path.basename(opts.script), spawn=self._forked(args) if trial else None,
                          on_line=None if trial else self.on_line)
            exit_ = self.forwarder.run(child)
            verdict = classify(exit_, agent.read_results(result_file), opts.host_budget_bytes)
        self.plan = verdict.plan or self.plan
        if self.forwarder.received is not None:
            raise Interrupted(self.forwarder.received)
        if not trial:
            _log_end(os.path.basename(opts.script), verdict)
        elif verdict.kind == "error" and not opts.verbose:
            _show_tail(exit_.output_tail)  # the trial's output was captured: show how it failed
        return verdict

    def _forked(self, args: list[str]) -> Callable[[dict[str, str]], Started | None] | None:
        """How a trial starts: forked by the fork server where it serves (`forkserver.py`); else None, and the
        child starts itself fresh."""
        if self.options.nproc_per_node is not None or self.forks_off:
            return None
        script = self.options.script

        def spawn(env: dict[str, str]) -> Started | None:
            if self.forks is None:
                self._start_forks(env)
            if self.forks is None:
                return None
            try:
                return self.forks.spawn([script, *args], env, os.getcwd())
            except ForkServerError as exc:
                self.close()
                self.forks_off = str(exc)
                log.warning("trials start as fresh processes from now on: %s", exc)
                return None
        return spawn

    def _start_forks(self, env: dict[str, str]) -> None:
        if not settings.switch(settings.FORK_TRIALS_ENV):
            self.forks_off = f"{settings.FORK_TRIALS_ENV}=0"
        elif not ForkServer.supported():
            self.forks_off = "forking trials needs Linux"
        if self.forks_off:
            return
        server = ForkServer(self.options.script, env)
        try:
            server.start()
        except ForkServerError as exc:
            self.forks_off = str(exc)
            log.info("trials start as fresh processes: the fork server did not start (%s)", exc)
            return
        self.forks = server
        self.forked = server.describe()
        log.info("%s", self.forked)

    def close(self) -> None:
        """Stop the fork server, if one runs: the real run starts fresh, and the server's memory is given back."""
        if self.forks is not None:
            self.forks.close()
            self.forks = None

    def _environment(self, extra: dict[str, str], result_file: str) -> dict[str, str]:
        env = {**os.environ, **allocator.job_environment(os.environ), **extra, agent.RESULT_FILE_ENV: result_file,
               agent.LOG_LEVEL_ENV: logging.getLevelName(logging.getLogger("autotune").getEffectiveLevel())}
        # The job imports autotune.supervisor.bootstrap from the same place we were imported from, even when
        # autotune is a source checkout that is not installed; appended, so it shadows nothing.
        home = os.path.dirname(os.path.dirname(os.path.abspath(agent.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), home) if p)
        return env


def _log_end(name: str, verdict: Verdict) -> None:
    how = verdict.kind if verdict.kind != "error" else f"exit code {verdict.exit_code}"
    peak = verdict.exit.peak_gpu_bytes
    log.info("%s ended: %s after %.1f s%s", name, how, verdict.exit.seconds,
             f"; GPU peak {format_bytes(peak)} (NVML, largest process)" if peak else "")


def _show_tail(text: str, lines: int = 40) -> None:
    tail = text.rstrip().splitlines()[-lines:]
    if tail:
        sys.stderr.write("\n".join(tail) + "\n")
