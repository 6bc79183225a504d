"""A plan's claimed throughput against what the real run then trained at.

The agent in the real run times every whole optimizer step (`measure.py`) and leaves, when the job ends,
the median of those after the first. The run's measured rate is the global batch over that median
(ranks step in lockstep: the slowest rank's median). The median, not the mean: a validation pass or a
checkpoint save lands inside one step and would otherwise be charged to training, and the plan claims
the steady training rate.

A claim and a measurement disagree when one is more than `NOISE_BAND` times the other. Trials measure
a few steps after a warm-up, the run many, so honest plans land within about 15% of their claim (a
loop's once-per-update work, clipping, scheduler and logging, is charged per micro-step by the time
model); a plan off by more than 1.25x was not measured as it trains, as when forward and backward run
inside `optimizer.step(closure)` where a timer of the gap between steps does not look.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..plan import Plan

log = logging.getLogger(__name__)

NOISE_BAND = 1.25  # claimed / measured beyond this either way is a disagreement worth recording


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    """The real run's training rate, from the agent's record."""

    samples_per_second: float
    steps: int  # optimizer steps the run made
    measured_steps: int  # of them, timed (all but the first)
    median_step_seconds: float


def measured(records: Iterable[dict[str, Any]], global_batch_size: int) -> Measured | None:
    """The run's rate from every rank's record; None when no rank timed a step (fewer than two steps)."""
    runs = [r["measured"] for r in records if isinstance(r.get("measured"), dict)
            and (r["measured"].get("median_step_seconds") or 0) > 0]
    if not runs:
        return None
    slowest = max(runs, key=lambda m: m["median_step_seconds"])
    seconds = float(slowest["median_step_seconds"])
    return Measured(samples_per_second=global_batch_size / seconds, steps=int(slowest.get("steps") or 0),
                    measured_steps=int(slowest.get("measured_steps") or 0), median_step_seconds=seconds)


def ratio(claimed: float, actual: float) -> float:
    """claimed / measured (inf when nothing was measured to train)."""
    return claimed / actual if actual > 0 else float("inf")


def disagrees(claimed: float, actual: float) -> bool:
    """The claim is off by more than the noise band, either way."""
    r = ratio(claimed, actual)
    return not 1 / NOISE_BAND <= r <= NOISE_BAND


def plan_disagrees(plan: Plan) -> bool:
    """`plan` carries a real run's measurement that its claim does not match."""
    return plan.measured_samples_per_second is not None and disagrees(plan.samples_per_second,
                                                                      plan.measured_samples_per_second)


def with_measurement(plan: Plan, run: Measured) -> Plan:
    return plan.with_evidence(measured_samples_per_second=run.samples_per_second)


def describe(plan: Plan, run: Measured) -> str:
    """One line: claimed against measured, their ratio, and the clock both were read on (`measure.clock`)."""
    # On the CPU two rates reach the user: this one and the script's own; each line says which is which.
    clock = ("both in the job's CPU time, the clock on the simulated device: trust these two to compare the plan "
             "with the run; a rate the script prints by the wall clock differs when other processes share the "
             "cores, and is the one that says how long training takes" if plan.device == "cpu" else "wall clock")
    return (f"the plan claimed {plan.samples_per_second:,.1f} samples/s; the run trained at "
            f"{run.samples_per_second:,.1f} samples/s (median of {run.measured_steps} whole optimizer steps, "
            f"{run.median_step_seconds * 1000:,.1f} ms each; {clock}): claimed/measured "
            f"{ratio(plan.samples_per_second, run.samples_per_second):.2f}")



def judge(plan: Plan, records: Iterable[dict[str, Any]]) -> Plan:
    """`plan` with what the real run measured, logged beside its claim (as is when the run made fewer than
    two optimizer steps)."""
    run = measured(records, plan.global_batch_size)
    if run is None:
        log.info("the run made fewer than two optimizer steps: no throughput measured")
        return plan
    judged = with_measurement(plan, run)
    if plan_disagrees(judged):
        log.warning("%s, outside the %.2fx noise band; recorded against the plan, so its next tune re-measures",
                    describe(plan, run), NOISE_BAND)
    else:
        log.info("%s", describe(plan, run))
    return judged
