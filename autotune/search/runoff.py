"""Step: the runoff. Decides between close leaders: when another configuration's best is within `RUNOFF` of
the pick, both are measured again with longer runs (near the memory edge single trials are erratic), and the
pick is the faster of the two re-measurements, within noise the one with the lower peak."""

from __future__ import annotations

import logging

from ..evidence import Trial
from .ledger import Ledger
from .lines import NOISE, RUNOFF

log = logging.getLogger("autotune.search.controller")


def runoff(s: Ledger) -> Ledger:
    """Step: the pick, after a runoff against its closest rival where one is close (`run_off`)."""
    s.pick = run_off(s, s.picked())
    return s


def run_off(s: Ledger, best: Trial) -> Trial:
    """Re-measure the leaders with longer runs when they are close: near the memory edge single
    trials are erratic (allocator retries, launch jitter), and the pick must not hinge on one."""
    if s.remeasure is None:
        return best
    ok = [t for t in s.trials if t.fits]
    rivals = sorted((t for t in ok if t.rung != best.rung and t.samples_per_second >= best.samples_per_second
                     * (1 - RUNOFF)), key=lambda t: -t.samples_per_second)
    if not rivals:
        return best
    finalists = [s.remeasure(t.rung, t.micro_batch_size) for t in (best, rivals[0])]
    for t in finalists:
        log.debug("runoff %-31s micro-batch %4d: %-11s %s samples/s", t.rung.name, t.micro_batch_size,
                  t.outcome, f"{t.samples_per_second:,.1f}")
    s.trials.extend(finalists)
    fitting = [t for t in finalists if t.fits]
    if not fitting:
        return best
    fastest = max(t.samples_per_second for t in fitting)
    close = [t for t in fitting if t.samples_per_second >= fastest * (1 - NOISE)]
    winner = min(close, key=lambda t: (t.peak_bytes, -t.samples_per_second))
    s.notes.append(f"runoff between {finalists[0].rung.name} @ {finalists[0].micro_batch_size} and "
                   f"{finalists[1].rung.name} @ {finalists[1].micro_batch_size}")
    return winner
