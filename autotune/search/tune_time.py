"""Where a tune's time goes: `Laps`, a stopwatch that splits elapsed time into named phases (a trial's, and the
tune's outside its trials); `account`, the sentence that says where a tune's seconds went; and `estimate_left`,
the time a search still plans to spend.

A trial's phases cover it end to end (each mark closes the phase in force and opens the next), so they add up to
its wall time by construction; what a phase holds depends on where `search/trial.py` puts the marks. They read
the host's clock without synchronising the device (after a poisoned CUDA context a synchronise would raise): the
timed steps synchronise at their own ends, so on a GPU only a little queued work can spill past a mark.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from ..evidence import Trial
from ..plan import Plan

OTHER = "other"  # the tune's time outside its trials that no named phase holds: the search's own arithmetic
SAID = 0.05  # seconds: a phase shorter than this is left out of the account


class Laps:
    """Elapsed time split into named phases: `enter(name)` credits the time since the last mark to the phase in
    force and makes `name` the one in force; `close()` credits the last. `phase(name)` times one section of a
    longer span whose other time is accounted elsewhere (the tune's time outside its trials)."""

    def __init__(self, first: str = "", clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.started = self._mark = clock()
        self.current = first
        self.phases: dict[str, float] = {}

    def enter(self, name: str) -> None:
        now = self.clock()
        if self.current:
            self.add(self.current, now - self._mark)
        self.current, self._mark = name, now

    def close(self) -> dict[str, float]:
        """Credit the phase in force; the phases, in the order they were first entered."""
        self.enter("")
        return dict(self.phases)

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + max(0.0, seconds)

    def move(self, source: str, target: str, seconds: float) -> None:
        """Credit up to `seconds` of `source`'s time to `target` instead: a part of a phase timed inside it (the
        compiling inside the warm-up, the host buffers inside the set-up)."""
        seconds = min(max(0.0, seconds), self.phases.get(source, 0.0))
        if seconds > 0:
            self.phases[source] -= seconds
            self.add(target, seconds)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.add(name, self.clock() - start)

    def elapsed(self) -> float:
        return self.clock() - self.started


def merged(phases: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The phases of several trials (or readings of one trial) added up by name."""
    total: dict[str, float] = {}
    for p in phases:
        for name, seconds in p.items():
            total[name] = total.get(name, 0.0) + seconds
    return total


def outside_trials(laps: Laps, trials: Sequence[Trial]) -> dict[str, float]:
    """The tune's phases outside its trials: the named sections `laps` timed, and `OTHER`, the rest of the time
    since it started that neither they nor the trials hold."""
    phases = {name: s for name, s in laps.phases.items() if s > 0}
    rest = laps.elapsed() - sum(t.seconds for t in trials) - sum(phases.values())
    return {**phases, OTHER: max(0.0, rest)}


def _said(phases: Mapping[str, float]) -> str:
    named = sorted(((s, n) for n, s in phases.items() if s >= SAID), reverse=True)
    return ", ".join(f"{n} {s:.1f} s" for s, n in named)


def account(seconds: float, trials: Sequence[Trial], outside: Mapping[str, float]) -> str:
    """Where a tune's `seconds` went, e.g. "tuned in 12.3 s: 8 trials 11.0 s (compile 5.1 s, measured 3.2 s,
    warm-up 2.0 s, set-up 0.7 s), outside trials 1.3 s (snapshot 0.8 s, other 0.5 s)"; phases by time."""
    spent = sum(t.seconds for t in trials)
    inside = _said(merged([t.phases for t in trials]))
    around = _said(outside)
    return (f"tuned in {seconds:.1f} s: {len(trials)} trial(s) {spent:.1f} s{f' ({inside})' if inside else ''}, "
            f"outside trials {sum(outside.values()):.1f} s{f' ({around})' if around else ''}")


def timed(plan: Plan, laps: Laps) -> Plan:
    """`plan`, tuned since `laps` started, with the tune's wall time and its phases outside the trials."""
    return plan.with_evidence(tune_seconds=laps.elapsed(), tune_phases=outside_trials(laps, plan.trials))


def account_of(plan: Plan) -> str:
    """`account` of a tuned plan's time (`timed`)."""
    return account(plan.evidence.tune_seconds, plan.trials, plan.evidence.tune_phases)


def estimate_left(seconds: Sequence[float], planned: int) -> float | None:
    """Seconds the search still needs, estimated: the mean of the trials' `seconds` so far times the trials it
    still plans; None before any trial ran (nothing to take a mean of)."""
    timed = [s for s in seconds if s > 0]
    if not timed:
        return None
    return planned * sum(timed) / len(timed)
