"""What the search is doing, told to a person while it runs.

On a terminal: a live status line for the trial in flight (configuration, micro-batch, trials so far,
elapsed), rewritten in place, and one permanent line per finished trial (outcome, peak, throughput).
Elsewhere (CI logs, files): one plain line per finished trial through the `autotune` logger, with no
control characters, so logs stay greppable. Always on stderr: stdout belongs to the user (`--json`).

Hand-written, on purpose. rich and tqdm are often installed (typer, transformers pull them in) but are not
dependencies of autotune, and a progress line is not worth a new hard one; tqdm draws bars towards a known
total, and a search does not know how many trials it will need; rich's Live takes the terminal over, and
a supervised job writes to the same terminal. A live line needs "carriage return, erase line", no more.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from .. import settings
from ..configuration import Rung
from ..evidence import Trial
from ..sizes import format_bytes, shorten
from .tune_time import estimate_left

log = logging.getLogger("autotune.progress")

PROGRESS_ENV = settings.PROGRESS_ENV  # "live", "lines" or "off": set by `autotune run` for the jobs it starts
_ERASE = "\r\x1b[2K"  # carriage return, then erase the whole line (ECMA-48 EL 2)
PINNING_SAID = 1 << 30  # host buffers from this size on are said in the live line: allocating them takes a while

Runner = Callable[..., Trial]


def progress_for(setting: bool | None, stream: TextIO | None = None) -> Progress | None:
    """The progress a caller asked for: None (the default), True (always show) or False (never).

    The default is a live line when `stream` (stderr) is a terminal, else plain lines through logging
    (seen where logging is configured, as `autotune run` does); `$AUTOTUNE_PROGRESS` overrides the
    default, so a job whose stderr `autotune run` pipes to a terminal still draws a live line.
    """
    stream = stream if stream is not None else sys.stderr
    if setting is False:
        return None
    mode = settings.read(PROGRESS_ENV).lower()
    if setting is None and mode == "off":
        return None
    tty = _is_terminal(stream)
    if mode == "live" or (mode != "lines" and tty):
        return Progress(stream, live=True)
    return Progress(stream, live=False, direct=setting is True)


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # closed, or not a real stream
        return False


class Progress:
    """Reports each trial as it starts and ends; `watch(runner)` wraps the controller's trial runner."""

    def __init__(self, stream: TextIO, *, live: bool, direct: bool = False) -> None:
        self.stream = stream
        self.live = live  # a status line rewritten in place; else plain lines
        self.direct = direct  # plain lines straight to `stream`, not through logging (fit(progress=True))
        self.started = time.perf_counter()
        self.count = 0
        self.ooms = 0
        self._drawn = False
        self.seconds: list[float] = []  # each finished trial's wall time
        # The trials the search still plans (`Controller.trials_planned`), for the estimate of the time left;
        # None: no estimate (a search not started, or one that cannot say)
        self.planned: Callable[[], int] | None = None

    def watch(self, runner: Runner, what: str = "trial",
              host_bytes: Callable[[Rung, dict[str, Any]], int] | None = None) -> Runner:
        """`runner` reporting each call: `what` names it ("trial", or "re-measure" for a re-measurement);
        `host_bytes(rung, kwargs)`, the host memory a trial allocates before it runs (offload's buffers):
        pinning gigabytes takes seconds to minutes, and the line then says that is what the trial waits on."""
        def watched(rung: Rung, micro: int, **kwargs: Any) -> Trial:
            self.begin(rung, micro, what, host_bytes(rung, kwargs) if host_bytes is not None else 0)
            trial = runner(rung, micro, **kwargs)
            self.end(trial, what)
            return trial

        return watched

    def begin(self, rung: Rung, micro: int, what: str = "trial", host_bytes: int = 0) -> None:
        if self.live:
            doing = (f"allocating {format_bytes(host_bytes)} of host memory for the offloaded optimizer, then running"
                     if host_bytes >= PINNING_SAID else "running")
            self._draw(f"autotune: {what} {self.count + 1}: {rung.name} at micro-batch {micro}, {doing}... "
                       f"({self._so_far()})")

    def end(self, trial: Trial, what: str = "trial") -> None:
        self.count += 1
        self.ooms += trial.outcome == "oom"
        self.seconds.append(trial.seconds)
        self.say(f"autotune: {what} {self.count}: {describe(trial)} ({self._so_far()})")

    def finish(self, account: str) -> None:
        """The last line: where the tune's time went (`tune_time.account`). Through logging, `fit`'s own closing
        log line says it already."""
        if self.live or self.direct:
            self.say(f"autotune: {account}")

    def say(self, line: str) -> None:
        """A permanent line: under the live line's place on a terminal, else plain."""
        if self.live:
            self._write(_ERASE + line + "\n")
            self._drawn = False
        elif self.direct:
            self._write(line + "\n")
        else:
            log.info("%s", line.removeprefix("autotune: "))

    def close(self) -> None:
        """Erase a status line left drawn (the search stopped inside a trial: an error, an interrupt)."""
        if self._drawn:
            self._write(_ERASE)
            self._drawn = False

    def _so_far(self) -> str:
        ooms = f", {self.ooms} OOM" if self.ooms else ""
        return f"{self.count} trial(s){ooms}, {time.perf_counter() - self.started:.1f} s{self._left()}"

    def _left(self) -> str:
        """", ~40 s left (estimate)": the mean trial's time so far times the trials the search still plans."""
        if self.planned is None or not self.seconds:
            return ""
        planned = self.planned()
        left = estimate_left(self.seconds, planned)
        if left is None:
            return ""
        return f", ~{_duration(left)} left (estimate, {planned} more trial(s))" if planned else ", nearly done"

    def _draw(self, text: str) -> None:
        self._write(_ERASE + text)
        self._drawn = True

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # stderr closed under us: progress is never worth failing a tune
            pass


def _duration(seconds: float) -> str:
    """Seconds as a person reads an estimate: "40 s", "3 min"."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def describe(trial: Trial) -> str:
    """One trial in a line: configuration, micro-batch, outcome, peak (and the host memory it raised, under
    offload) and throughput, or why it failed."""
    head = f"{trial.rung.name} at micro-batch {trial.micro_batch_size}: {trial.outcome}"
    if trial.outcome == "ok":
        host = (f", host +{format_bytes(trial.host_peak_bytes)}" if trial.rung.offload != "none"
                and trial.host_peak_bytes else "")
        return f"{head}, peak {format_bytes(trial.peak_bytes)}{host}, {trial.samples_per_second:,.1f} samples/s"
    note = shorten(trial.note, 90)
    return f"{head}{', ' + note if note else ''}"
