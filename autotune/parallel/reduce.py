"""Gradient reduction over ranks: replicated ranks' buckets all-reduced beside the last backward, grouped
collectives, and the token-count fix-up of FSDP2's reduced gradients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import torch_private
from ..workload.accumulation import LossWeights
from .ranks import collective_device, world_size

_coalescing_manager = torch_private.coalescing_manager  # one collective for a bucket (None: one per tensor)


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
    exit's buckets make an agreement before the last backward, a wait for the device, unnecessary.) An exception that is
    not an OOM only removes the hooks. `wait` finishes the all-reduces and returns the global mean loss.

    A parameter with no gradient on this rank (a head or an MoE expert this rank's batch did not reach) goes
    into its bucket as zeros, so the ranks that have one average it with zeros, as DDP with
    `find_unused_parameters=True` does. One with no gradient on any rank keeps `.grad` None on every rank, so
    the optimizer skips it as torch's does (no weight decay, no moment update, no step count): each bucket's
    collective carries one flag per parameter (1 where the rank has a gradient), summed with the gradients,
    and `wait` reads the summed flags only where this rank lacked a gradient (a wait for the device, in steps
    that have such a parameter only).

    With `overlap` False (`Plan.reduce_overlap`) the gradients go in one bucket, all-reduced once backward has
    made the last of them: nothing runs beside the backward, which can be faster where the
    backward is bound by launches (the partitioned optimizer state); `fit` times both.
    """

    def __init__(self, model: torch.nn.Module, weights: LossWeights | None, *, overlap: bool = True) -> None:
        device = collective_device()
        # (samples, tokens, loss total, means total) of this rank; zeros from a rank that ran out of memory before
        # the last backward (`weights` None), which only joins the all-reduces: every rank re-runs the batch after.
        self.totals = (weights.totals(device) if weights is not None
                       else torch.zeros(4, dtype=torch.float64, device=device))
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
        # (bucket, its summed flags, positions in it this rank had no gradient for): the candidates for None
        self.unused_here: list[tuple[list[torch.Tensor], torch.Tensor, list[int]]] = []
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
        bucket = self.buckets[self.started]
        grads, missing = [], []
        for k, p in enumerate(bucket):
            if p.grad is None:  # a branch this rank did not take (or an OOM): the others still send theirs
                p.grad = torch.zeros_like(p)
                missing.append(k)
            grads.append(p.grad)
        if self.factor != 1.0:
            torch._foreach_mul_(grads, self.factor)
        # One flag per parameter, in the bucket's dtype so that the backend takes it in the same collective
        # (gloo coalesces one dtype only); a sum of ones stays above 0 whatever the rounding.
        flags = torch.ones(len(bucket), dtype=grads[0].dtype, device=grads[0].device)
        for k in missing:
            flags[k] = 0
        if missing:
            self.unused_here.append((bucket, flags, missing))
        self.works.append(all_reduce_together([*grads, flags]))
        self.started += 1

    def wait(self, weights: LossWeights) -> torch.Tensor:
        """Wait for every all-reduce; the global mean loss."""
        self._summed.wait()
        for work in self.works:
            work.wait()
        self.works = []
        self._drop_unused()
        return weights.global_mean_loss(self.totals)

    def _drop_unused(self) -> None:
        """`.grad` back to None for each parameter no rank had a gradient for. Only a parameter this rank lacked
        can be one, so a step where this rank had every gradient reads nothing back from the device."""
        for bucket, flags, missing in self.unused_here:
            summed = flags.tolist()
            for k in missing:
                if summed[k] == 0:
                    bucket[k].grad = None
        self.unused_here = []


def all_reduce_together(tensors: list[torch.Tensor]) -> Any:
    """Start one SUM all-reduce of every tensor in `tensors` (one dtype, one device): its work, to `wait` on.

    One collective for the whole bucket, as DDP's flat bucket is, without copying into a flat buffer: the
    tensors go to the backend together (NCCL: one group, launched once; gloo: flattened by the backend). One
    all-reduce per tensor is one launch per parameter, each a host call in the middle of the last backward. Per tensor
    where torch lacks the coalescing manager (it is private to torch.distributed, present in torch 2.11 and 2.13).
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
    `all_reduce_together` does for a bucket; a partitioned optimizer's per-parameter broadcasts after
    every step would be one launch each otherwise. Each tensor must be on this rank's device and contiguous.
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


def _buckets(params: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
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


def finish_sharded(model: torch.nn.Module, weights: LossWeights) -> torch.Tensor:
    """FSDP2: the gradients are already reduced (averaged over ranks); token losses still need the global count.

    Every rank weighed its micro-batches by the same divisor (`TrainingStep._loss_weights`), so one factor,
    the same on every shard, makes the averaged sums the full-batch gradient: world / global tokens.
    """
    totals = weights.totals(collective_device())
    dist.all_reduce(totals)
    if weights.by_tokens:
        factor = world_size() / max(float(totals[1]), 1.0)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)
    return weights.global_mean_loss(totals)
