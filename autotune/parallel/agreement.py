"""Ranks agreeing on a trial: the worst outcome, the highest peak, the slowest step, on every rank.

Under torchrun every rank runs the same trial; before anyone moves on, the ranks all-reduce the OOM
flag with MAX, so a rank that ran out of memory and ranks that did not take the same branch and no
rank is left waiting in a collective.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..evidence import NOISY, TRIAL_PHASES, Trial
from .oom import agree_oom
from .ranks import active, collective_device

# Worse outcomes have higher codes, so MAX over ranks is the worst. A failure other than memory (an error, such as
# compile's, or a NaN or infinite loss) beats an OOM: every rank must then leave the configuration alike.
_OUTCOME_CODE = {"ok": 0, "over_budget": 1, "oom": 2, "error": 3, "non_finite": 4}
_ANOTHER_RANK = {"oom": "another rank ran out of memory", "over_budget": "another rank's peak was over the limit",
                 "error": "an error on another rank", "non_finite": "a NaN or infinite loss on another rank"}


def agree_trial(trial: Trial) -> Trial:
    """The same trial on every rank: the worst outcome, the highest peak, the slowest step.

    The controller's next decision depends on the trial alone, so identical trials keep every rank on
    the same path with no further talk. MAX over ranks is right for each figure: the plan must fit on
    the fullest GPU, and a data-parallel step is as slow as its slowest rank.
    """
    if not active():
        return trial
    agree_oom(trial.outcome == "oom")  # ends the check-ins of ranks a sharded trial's OOM left mid-step
    agreed = torch.tensor(trial_figures(trial), dtype=torch.float64, device=collective_device())
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return merged_trial(trial, agreed.tolist())


def trial_figures(trial: Trial) -> list[float]:
    """What `agree_trial` all-reduces with MAX; the rate goes in negated, so MAX gives the slowest rank's."""
    return [float(_OUTCOME_CODE[trial.outcome]), float(trial.peak_bytes), trial.step_seconds,
            trial.optimizer_seconds, float(trial.alloc_retries), -trial.samples_per_second, trial.seconds,
            trial.compile_seconds, float(trial.noisy), trial.reduce_seconds, trial.reduce_after_seconds,
            float(trial.host_peak_bytes), *(trial.phases.get(name, 0.0) for name in TRIAL_PHASES)]


def merged_trial(trial: Trial, agreed: list[float]) -> Trial:
    """This rank's `trial` with the figures agreed over ranks (`trial_figures`, MAX over ranks): each phase the
    slowest rank's, and its seconds their sum (where the trial timed its phases)."""
    code, peak, step_s, opt_s, retries, neg_rate, seconds, compile_s, noisy, reduce_s, after_s, host = agreed[:12]
    phases = {name: s for name, s in zip(TRIAL_PHASES, agreed[12:]) if s > 0}
    seconds = sum(phases.values()) if phases else seconds
    outcome = next(k for k, v in _OUTCOME_CODE.items() if v == int(code))
    ran = outcome in ("ok", "over_budget")
    note = trial.note if outcome == trial.outcome else _ANOTHER_RANK[outcome]
    if noisy and not (trial.noisy and outcome == trial.outcome):  # said in words where this rank's note does not
        note = f"{note}; {NOISY} on another rank" if note else f"{NOISY} on another rank"
    return dataclasses.replace(trial, outcome=outcome, peak_bytes=int(peak), step_seconds=step_s if ran else 0.0,
                               optimizer_seconds=opt_s if ran else 0.0, alloc_retries=int(retries),
                               samples_per_second=-neg_rate if ran else 0.0, seconds=seconds,
                               compile_seconds=compile_s, reduce_seconds=reduce_s if ran else 0.0,
                               reduce_after_seconds=after_s if ran else 0.0, host_peak_bytes=int(host),
                               noisy=bool(noisy), note=note,  # every rank counts the same noisy trials
                               phases=phases)
