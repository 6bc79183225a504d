"""torch.distributed facts and the collectives autotune needs: agreeing on a trial, and on an OOM.

Under torchrun every rank runs the same trial; before anyone moves on, the ranks all-reduce the OOM
flag with MAX, so a rank that ran out of memory and ranks that did not take the same branch and no
rank is left waiting in a collective (PEERS.md lesson 10). In training the replicated gradients are
summed while the last backward runs (`OverlappedReduce`), between two such agreements.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..devices.ceiling import host_memory
from ..workload.accumulation import LossWeights
from ..evidence import NOISY, Trial

try:  # private to torch.distributed (present in torch 2.11 and 2.13): one collective for a bucket of tensors
    from torch.distributed.distributed_c10d import _coalescing_manager
except ImportError:  # pragma: no cover - older torch: one all-reduce per tensor
    _coalescing_manager = None


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def is_writer() -> bool:
    """Only rank 0 writes shared state (the cache, result files)."""
    return rank() == 0


# Worse outcomes have higher codes, so MAX over ranks is the worst. "error" (compile failed on a rank) is the
# worst: every rank must then leave compile, or the ranks' searches part ways.
_OUTCOME_CODE = {"ok": 0, "over_budget": 1, "oom": 2, "error": 3}
_ANOTHER_RANK = {"oom": "another rank ran out of memory", "over_budget": "another rank's peak was over the limit",
                 "error": "compile failed on another rank"}


def agree_trial(trial: Trial) -> Trial:
    """The same trial on every rank: the worst outcome, the highest peak, the slowest step.

    The controller's next decision depends on the trial alone, so identical trials keep every rank on
    the same path with no further talk. MAX over ranks is right for each figure: the plan must fit on
    the fullest GPU, and a data-parallel step is as slow as its slowest rank.
    """
    if not active():
        return trial
    agree_oom(trial.outcome == "oom")  # ends the check-ins of ranks a sharded trial's OOM left mid-step
    agreed = torch.tensor(trial_figures(trial), dtype=torch.float64, device=_collective_device())
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return merged_trial(trial, agreed.tolist())


def trial_figures(trial: Trial) -> list[float]:
    """What `agree_trial` all-reduces with MAX; the rate goes in negated, so MAX gives the slowest rank's."""
    return [float(_OUTCOME_CODE[trial.outcome]), float(trial.peak_bytes), trial.step_seconds,
            trial.optimizer_seconds, float(trial.alloc_retries), -trial.samples_per_second, trial.seconds,
            trial.compile_seconds, float(trial.noisy), trial.reduce_seconds, trial.reduce_after_seconds]


def merged_trial(trial: Trial, agreed: list[float]) -> Trial:
    """This rank's `trial` with the figures agreed over ranks (`trial_figures`, MAX over ranks)."""
    code, peak, step_s, opt_s, retries, neg_rate, seconds, compile_s, noisy, reduce_s, after_s = agreed
    outcome = next(k for k, v in _OUTCOME_CODE.items() if v == int(code))
    ran = outcome in ("ok", "over_budget")
    note = trial.note if outcome == trial.outcome else _ANOTHER_RANK[outcome]
    if noisy and not (trial.noisy and outcome == trial.outcome):  # said in words where this rank's note does not
        note = f"{note}; {NOISY} on another rank" if note else f"{NOISY} on another rank"
    return dataclasses.replace(trial, outcome=outcome, peak_bytes=int(peak), step_seconds=step_s if ran else 0.0,
                               optimizer_seconds=opt_s if ran else 0.0, alloc_retries=int(retries),
                               samples_per_second=-neg_rate if ran else 0.0, seconds=seconds,
                               compile_seconds=compile_s, reduce_seconds=reduce_s if ran else 0.0,
                               reduce_after_seconds=after_s if ran else 0.0,
                               noisy=bool(noisy), note=note)  # every rank counts the same noisy trials


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collective_device() -> torch.device:
    """Where a tensor must be for a collective of the current backend (CUDA for NCCL, else the CPU)."""
    return _collective_device()


def smallest(value: int) -> int:
    """The smallest `value` over all ranks (a memory budget: the plan must fit on the tightest GPU)."""
    if not active():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


# -- an OOM on one rank while the others go on ----------------------------------------------------------
# Replicated, no collective runs inside an attempt before the ranks agree (see `TrainingStep._attempt`). A
# sharded model is different: FSDP2 all-gathers each block before its forward and backward and
# reduce-scatters its gradients after, so a rank that runs out of memory between two of those leaves the step
# while the others go on into the next collective and wait there for it for good (seen on the CPU: one rank
# in `agree_oom`, three in a backward prefetch all-gather). While an OOM is possible (`armed`: the trials, a
# plan's first steps, after a recovery) each of FSDP's collectives is preceded by a check-in
# (`guard_collectives`): one all-reduce (MAX) of [ran out of memory, still in the step]. A rank that ran out of
# memory comes to no further check-in: it goes to the end of the attempt (`agree_oom`), which answers the
# others' check-ins with [1, 0] until no rank is still in the step; a rank whose check-in hears of an OOM
# raises one of its own there and goes to the end too. So every rank leaves at the same collective and all
# re-run the batch. The idea is Composer's FSDP sync hook; placed inside FSDP's own collectives, no other
# collective runs between a check-in and the one it guards. Armed, it costs a small all-reduce and a host
# sync per FSDP collective, so steady training (plan proven for a few steps) runs without it.
_armed = 0
ANOTHER_RANK_OOM = "CUDA out of memory on another rank (autotune stopped this rank at the same collective)"


@contextlib.contextmanager
def armed(on: bool = True) -> Iterator[None]:
    """Check in before each guarded FSDP collective inside this block (every rank must arm alike)."""
    global _armed
    if not on:
        yield
        return
    _armed += 1
    try:
        yield
    finally:
        _armed -= 1


def check_in() -> None:
    """Before an FSDP collective: raise an OOM here when another rank has run out of memory."""
    if not _armed or not active():
        return
    oom, _ = _exchange(oom=False, in_step=True)
    if oom:
        raise torch.OutOfMemoryError(ANOTHER_RANK_OOM)


def agree_oom(oom: bool) -> bool:
    """At the end of an attempt: True on every rank when any rank ran out of memory.

    Answers the check-ins of ranks still in the step until none is, so it also ends theirs (see above).
    """
    if not active():
        return oom
    while True:
        any_oom, in_step = _exchange(oom=oom, in_step=False)
        if not in_step:
            return any_oom


def _exchange(*, oom: bool, in_step: bool) -> tuple[bool, bool]:
    # Uncounted by the simulated ceiling: its OOM raised here, after the all-reduce and before the collective
    # this check-in guards, would leave this rank out of a collective the others just agreed to run.
    with host_memory():
        flags = torch.tensor([int(oom), int(in_step)], dtype=torch.int32, device=_collective_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        any_oom, any_in_step = flags.tolist()
    return bool(any_oom), bool(any_in_step)


class _CheckedIn:
    """FSDP's all-gather or reduce-scatter, preceded by `check_in` (`FSDPModule.set_custom_*`)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        check_in()
        return self.inner(*args, **kwargs)


def guard_collectives(model: torch.nn.Module) -> bool:
    """Put a check-in before every FSDP2 collective of `model` (idempotent); False where torch cannot."""
    from torch.distributed.fsdp import FSDPModule

    from ..techniques.sharding import param_groups

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units or not hasattr(units[0], "set_custom_all_gather"):
        return False
    for unit in units:
        groups = param_groups(unit._get_fsdp_state())
        if len(groups) != 1:
            continue  # a unit without parameters runs no collective; several groups cannot take a custom comm
        group = groups[0]
        if not isinstance(group._all_gather_comm, _CheckedIn):
            unit.set_custom_all_gather(_CheckedIn(group._all_gather_comm))
        if not isinstance(group._reduce_scatter_comm, _CheckedIn):
            unit.set_custom_reduce_scatter(_CheckedIn(group._reduce_scatter_comm))
    return True


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb: big enough to keep the link busy, small enough to start early
ONE_BUCKET = 2**62  # every gradient of a dtype in one bucket: its all-reduce starts when backward has made the last


class OverlappedReduce:
    """Data parallel, model replicated: sum the ranks' gradients while the last micro-batch's backward runs.

    DDP's scheme without DDP's wrapper. The trainable parameters, last first (the order backward produces
    their gradients), are cut into buckets of about `BUCKET_BYTES`. When backward has accumulated the last
    gradient of a bucket, its gradients are scaled by this rank's share of the global batch and all-reduced
    (SUM, async, in place: no extra buffers), while backward goes on with the layers below. Buckets start in
    the same order on every rank, as collectives must: a bucket ready before an earlier one waits for it.

    Use it as a context around the last backward, entered by every rank (`TrainingStep._attempt`), also by
    one that ran out of memory in an earlier micro-batch (`weights` None: it skips the last backward). Its
    entry sums the sample and token counts over ranks, asynchronously: each rank's share factor is 1 when
    the global counts were known up front (`LossWeights.share_known`), and is read from the sums only
    otherwise, a read that waits for the device. Its exit starts every bucket this rank has not started:
    those of parameters backward never reached, or all of them on a rank that ran out of memory, so no rank
    is left waiting in an all-reduce; the ranks then agree on the OOM before anyone uses a gradient. (The
    ranks no longer agree before the last backward as well: that agreement, a wait for the device right
    before it, is what the exit's buckets make unnecessary.) An exception that is not an OOM only removes
    the hooks. `wait` finishes the all-reduces and returns the global mean loss.

    With `overlap` False (`Plan.reduce_overlap`) the gradients go in one bucket, all-reduced once backward has
    made the last of them: nothing runs beside the backward, which on two H200s trained 2-3% faster than the
    buckets under the partitioned optimizer state (RESULTS.md tenth session); `fit` times both.
    """

    def __init__(self, model: torch.nn.Module, weights: LossWeights | None, *, overlap: bool = True) -> None:
        device = _collective_device()
        # (samples, tokens, loss total, means total) of this rank; zeros from a rank that ran out of memory before
        # the last backward (`weights` None), which only joins the all-reduces: every rank re-runs the batch after.
        self.totals = weights.totals(device) if weights is not None else torch.zeros(4, dtype=torch.float64, device=device)
        self._summed = dist.all_reduce(self.totals, async_op=True)
        # Each rank's share factor: 1 when the counts were summed before the first micro-batch (`share_known`),
        # without waiting here for the device and the other ranks; else from the summed totals.
        self.factor = 1.0
        if weights is not None and not weights.share_known():
            self._summed.wait()
            self.factor = weights.share(self.totals)
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = _buckets(params[::-1], BUCKET_BYTES if overlap else ONE_BUCKET)
        self.missing = [len(b) for b in self.buckets]  # gradients each bucket still waits for
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.started = 0  # buckets started, always a prefix
        self.works: list[Any] = []
        self.handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in params]

    def __enter__(self) -> OverlappedReduce:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if exc_type is None:
            while self.started < len(self.buckets):
                self._start()

    def _accumulated(self, p: torch.Tensor) -> None:
        self.missing[self.bucket_of[id(p)]] -= 1
        while self.started < len(self.buckets) and self.missing[self.started] <= 0:
            self._start()

    @torch.no_grad()
    def _start(self) -> None:
        grads = []
        for p in self.buckets[self.started]:
            if p.grad is None:  # a branch this rank did not take (or an OOM): the others still send theirs
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if self.factor != 1.0:
            torch._foreach_mul_(grads, self.factor)
        self.works.append(all_reduce_together(grads))
        self.started += 1

    def wait(self, weights: LossWeights) -> torch.Tensor:
        """Wait for every all-reduce; the global mean loss."""
        self._summed.wait()
        for work in self.works:
            work.wait()
        self.works = []
        return weights.global_mean_loss(self.totals)


def all_reduce_together(tensors: list[torch.Tensor]) -> Any:
    """Start one SUM all-reduce of every tensor in `tensors` (one dtype, one device): its work, to `wait` on.

    One collective for the whole bucket, as DDP's flat bucket is, without copying into a flat buffer: the
    tensors go to the backend together (NCCL: one group, launched once; gloo: flattened by the backend). One
    all-reduce per tensor was ~290 launches per step for GPT-2 medium, each a host call in the middle of the
    last backward on a model whose backward is bound by launches. Per tensor where torch lacks the
    coalescing manager (it is private to torch.distributed, present in torch 2.11 and 2.13).
    """
    if len(tensors) == 1 or _coalescing_manager is None:
        works = [dist.all_reduce(t, async_op=True) for t in tensors]
        return works[0] if len(works) == 1 else _Works(works)
    with _coalescing_manager(async_ops=True) as together:
        for t in tensors:
            dist.all_reduce(t)
    return together


def broadcast_together(pairs: list[tuple[torch.Tensor, int]]) -> Any:
    """Start a broadcast of every (tensor, source rank) in `pairs`, in place: one work, to `wait` on.

    Under NCCL the broadcasts go out as one group (one launch, whichever rank each comes from), as
    `all_reduce_together` does for a bucket; a partitioned optimizer's ~290 per-parameter broadcasts after
    every step were as many launches otherwise. Each tensor must be on this rank's device and contiguous.
    Per tensor under gloo (which does not group) or where torch lacks the coalescing manager.
    """
    device = pairs[0][0].device if pairs else None
    if device is None or device.type != "cuda" or _coalescing_manager is None or len(pairs) == 1:
        return _Works([dist.broadcast(t, src, async_op=True) for t, src in pairs])
    with _coalescing_manager(device=device, async_ops=True) as together:
        for t, src in pairs:
            dist.broadcast(t, src, async_op=True)  # waited through the group's work, never inside the group
    return together


class _Works:
    """Several works waited on as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _buckets(params: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """`params` in order, cut into consecutive groups of about `bucket_bytes` (each holds at least one, and one
    dtype: a bucket is all-reduced as one collective)."""
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and (size + nbytes > bucket_bytes or p.dtype != buckets[-1][-1].dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return [b for b in buckets if b]


def sum_over_ranks(values: list[float]) -> list[float]:
    """Each figure summed over all ranks (float64: sample and token counts add exactly)."""
    if not active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t)
    return t.tolist()


def total_and_range(samples: int, steps: int) -> tuple[float, int, int]:
    """(samples summed over ranks, fewest micro-steps of any rank, most micro-steps of any rank)."""
    if not active():
        return float(samples), steps, steps
    t = torch.tensor([float(samples), -float(steps), float(steps)], dtype=torch.float64, device=_collective_device())
    total = t[:1].clone()
    dist.all_reduce(total)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(total.item()), int(-t[1].item()), int(t[2].item())


def finish_sharded(model: torch.nn.Module, weights: LossWeights) -> torch.Tensor:
    """FSDP2: the gradients are already reduced (averaged over ranks); token losses still need the global count.

    Every rank weighed its micro-batches by the same divisor (`TrainingStep._loss_weights`), so one factor,
    the same on every shard, makes the averaged sums the full-batch gradient: world / global tokens.
    """
    totals = weights.totals(_collective_device())
    dist.all_reduce(totals)
    if weights.by_tokens:
        factor = world_size() / max(float(totals[1]), 1.0)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)
    return weights.global_mean_loss(totals)
