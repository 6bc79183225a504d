"""torch.distributed facts and the collectives autotune needs: agreeing on a trial, and on an OOM.

Under torchrun every rank runs the same trial; before anyone moves on, the ranks all-reduce the OOM
flag with MAX, so a rank that ran out of memory and ranks that did not take the same branch and no
rank is left waiting in a collective (PEERS.md lesson 10).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .plan import Trial


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def is_writer() -> bool:
    """Only rank 0 writes shared state (the cache, result files)."""
    return rank() == 0


_OUTCOME_CODE = {"ok": 0, "over_budget": 1, "oom": 2}


def agree_trial(trial: Trial) -> Trial:
    """The same trial on every rank: the worst outcome, the highest peak, the slowest step.

    The controller's next decision depends on the trial alone, so identical trials keep every rank on
    the same path with no further talk. MAX over ranks is right for each figure: the plan must fit on
    the fullest GPU, and a data-parallel step is as slow as its slowest rank.
    """
    if not active():
        return trial
    # One MAX all-reduce; the rate goes in negated, so MAX gives the slowest rank's rate.
    figures = [float(_OUTCOME_CODE[trial.outcome]), float(trial.peak_bytes), trial.step_seconds,
               trial.optimizer_seconds, float(trial.alloc_retries), -trial.samples_per_second, trial.seconds]
    agreed = torch.tensor(figures, dtype=torch.float64, device=_collective_device())
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    code, peak, step_s, opt_s, retries, neg_rate, seconds = agreed.tolist()
    outcome = next(k for k, v in _OUTCOME_CODE.items() if v == int(code))
    ran = outcome != "oom"
    note = trial.note
    if outcome != trial.outcome:
        note = "another rank ran out of memory" if not ran else "another rank's peak was over the limit"
    return dataclasses.replace(trial, outcome=outcome, peak_bytes=int(peak), step_seconds=step_s if ran else 0.0,
                               optimizer_seconds=opt_s if ran else 0.0, alloc_retries=int(retries),
                               samples_per_second=-neg_rate if ran else 0.0, seconds=seconds, note=note)


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def smallest(value: int) -> int:
    """The smallest `value` over all ranks (a memory budget: the plan must fit on the tightest GPU)."""
    if not active():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def agree_oom(oom: bool) -> bool:
    """True on every rank when any rank ran out of memory."""
    if not active():
        return oom
    flag = torch.tensor([1 if oom else 0], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
