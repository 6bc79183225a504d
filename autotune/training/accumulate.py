"""Exact gradient accumulation over a batch's micro-batches, and the gradients made the whole global batch's.

Each micro-batch's loss is weighted by its share of the samples (or of the label tokens, when the loss
returns `(loss_sum, count)`), so the accumulated gradient equals one full-batch step, also when the last
micro-batch is smaller. The last micro-batch's backward is kept apart (`last_backward`): replicated ranks
all-reduce beside it and optimizer offload steps during it.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import parallel
from ..devices.placement import Placement
from ..errors import InvalidSetting
from ..workload import batch as batches
from ..workload import loss_checks
from ..workload.accumulation import LossWeights, weighted_loss
from ..workload.batching import split_sizes
from ..workload.loss_choice import int_labels, label_counts, recorded_choice
from ..workload.losses import LossForm, chunked_default_loss, is_default, resolve

if TYPE_CHECKING:  # plan.py sits above training/ and imports it
    from ..plan import Plan


class Accumulator:
    """Forward and backward over every micro-batch of one attempt; `micro_step` is the one running now.

    `notes` collects (kind, note) about what of the loss could not be weighted part by part; the step takes
    them (`take_notes`) and says each kind once, in a warning and in `plan.reason`.

    Where no check on an example ran for this model and loss (a plan applied without `fit` in this process),
    the first batch is the example: the chunked loss and the weighting are checked on it before its first
    micro-batch (`loss_checks.py`), and what fails is not used.
    """

    def __init__(self, model: nn.Module, loss_fn: Any, placement: Placement, *, sharded: bool) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.placement = placement
        self.sharded = sharded  # FSDP2: it reduces the gradients itself
        self.replicated = parallel.active() and not sharded  # autotune reduces them (OverlappedReduce)
        self.form = LossForm.of(model)  # whether the default loss passes num_items_in_batch; what it holds
        self._user_loss_fn = None if is_default(loss_fn) else loss_fn
        self._checked = recorded_choice(model, self._user_loss_fn) is not None
        self.notes: list[tuple[str, str | None]] = []
        self.micro_step = -1  # the micro-batch running now, for the record of a recovery
        self.micro_size = 0  # and its number of samples
        self._last_loss: torch.Tensor | None = None  # the last micro-batch's loss, until its backward
        self._last_index = 0

    def forward(self, applied: Any, plan: Plan, batch: Any, n: int) -> LossWeights:
        """Forward and backward over every micro-batch but the last one's backward; the weights."""
        self.micro_step = -1
        sizes = split_sizes(n, plan.micro_batch_size, plan.min_micro_batch_size)
        # A smaller odd one out runs first: the last backward is the one optimizer offload overlaps its
        # step with, and a full one gives it the most time.
        sizes = sorted(sizes)
        counts = _per_sample(label_counts(self.model, batch))  # label tokens per sample, before the first forward
        weights = self._loss_weights(n, len(sizes), counts, plan.micro_batch_size)
        start = 0
        for index, size in enumerate(sizes):
            self.micro_step, self.micro_size = index, size
            micro = applied.inputs(batches.to_device(batches.take(batch, start, start + size),
                                                     self.placement.torch_device))
            expected = None if counts is None else math.fsum(counts[start:start + size])
            start += size
            with applied.autocast():
                loss = weighted_loss(self.loss_fn, self.model, micro, weights, size, expected=expected,
                                     form=self.form)
            if index == len(sizes) - 1:
                self._last_loss, self._last_index = loss, index  # its graph, kept for last_backward
            elif loss is not None:
                applied.backward(loss)
            del loss, micro  # free the graph's last references before the next forward
        self.micro_step = -1  # all ran: an OOM reported now came from another rank
        return weights

    def check_once(self, applied: Any, plan: Plan, batch: Any) -> None:
        """Before the first step of a model and loss no check ran for: check the loss on this batch
        (`loss_checks.check`), follow what it found, and note what it refused. Its forwards take no more
        samples than a micro-batch (2 at least, to split), outside the step's memory and its record. Only the
        model's own loss is checked here, where autotune guesses how it counts labels or chunks it; a `loss_fn`
        keeps its contract (a scalar is a mean over samples), which `fit` checks."""
        if self._checked:
            return
        self._checked = True
        chunked = self.loss_fn is chunked_default_loss
        if self._user_loss_fn is not None or (int_labels(batch) is None and not chunked):
            return
        device = self.placement.torch_device
        found = loss_checks.check_and_record(
            self.model, batch, self._user_loss_fn, chunked=chunked,
            prepare=lambda part: applied.inputs(batches.to_device(part, device)),
            agree=loss_checks.on_every_rank(parallel.sum_over_ranks, parallel.world_size()),
            most=max(2, plan.micro_batch_size), together=lambda: parallel.leaving_together(self.model))
        self.loss_fn = resolve(self._user_loss_fn, self.model, chunked=chunked)
        self.form = LossForm.of(self.model)
        if found.notes:
            self.notes.append(("check", "; ".join(found.notes)))

    def drop_last(self) -> None:
        """Another rank failed: this rank's last graph is dropped unused."""
        self._last_loss = None

    def last_backward(self, applied: Any, *, overlap: bool, defer: bool) -> None:
        """The last micro-batch's backward; the optimizer steps right after it (overlapped offload arms here)."""
        loss, self._last_loss = self._last_loss, None  # this frame owns the graph now: an OOM frees it with it
        self.micro_step = self._last_index
        if loss is not None:
            applied.backward(loss, last=overlap, defer=defer)
        self.micro_step = -1

    def overlap_allowed(self, weights: LossWeights, *, callback: bool) -> bool:
        """Whether the host may take each gradient as final in the last backward (overlapped optimizer
        offload): not when something changes the device gradients after backward (a reduction over ranks,
        the token-count correction, a callback before the step). Clipping and loss scaling do not: the
        host applies them to its own copies, after backward (`defer`)."""
        return not parallel.active() and not self.sharded and not callback and not weights.needs_correction()

    def reduction(self, weights: LossWeights | None, *, overlap: bool) -> contextlib.AbstractContextManager[Any]:
        """Replicated on several ranks: the all-reduce that overlaps the last backward (None: this rank ran out
        of memory before it, and only joins the all-reduces); else nothing to do."""
        if not self.replicated:
            return contextlib.nullcontext()
        return parallel.OverlappedReduce(self.model, weights, overlap=overlap)

    def finish(self, weights: LossWeights, reduction: Any) -> torch.Tensor:
        """Make the accumulated gradients the whole global batch's; the mean loss over it, detached.

        One process: the token-count correction. Under torch.distributed (the model replicated): every
        rank's share rescaled and summed over ranks during the last backward (`parallel.OverlappedReduce`),
        so the update equals one full-batch step on one process and every rank returns the same loss.
        """
        self.notes.append(("parts", self.form.note))
        if self.sharded:
            return parallel.finish_sharded(self.model, weights)
        if reduction is not None:
            self.notes.append(("estimate", weights.inexact(reduction.factor)))
            return reduction.wait(weights)
        self.notes.append(("estimate", weights.inexact()))
        weights.correct(self.model)
        return weights.mean_loss()

    def take_notes(self) -> list[tuple[str, str | None]]:
        notes, self.notes = self.notes, []
        return notes

    def _loss_weights(self, n: int, steps: int, counts: list[float] | None, micro: int) -> LossWeights:
        tokens = None if counts is None else math.fsum(counts)
        if not self.sharded:
            if not parallel.active():
                return LossWeights(n, steps, total=tokens)
            # The global samples and label tokens, known before the first micro-batch (every rank gets
            # here before any can fail), so each rank weighs by them directly.
            samples, total = parallel.sum_over_ranks([float(n), tokens or 0.0])
            return LossWeights(n, steps, divisor=samples, total=None if tokens is None else total, summed=True)
        # FSDP averages the gradients over ranks inside backward, so every rank must weigh alike: n_i over
        # (global samples / world) for mean losses, plain sums for token losses (finish_sharded divides by
        # the global count). The sum runs before any micro-batch, where every rank arrives.
        world = parallel.world_size()
        total, fewest, most = parallel.total_and_range(n, steps)
        if fewest != most:  # FSDP's collectives run in every micro-step: unequal counts would leave one waiting
            raise InvalidSetting(f"under FSDP every rank must run the same number of micro-batches, but they range "
                                 f"from {fewest} to {most} at micro-batch {micro}; give every "
                                 f"rank the same number of samples (global batch / world size)")
        return LossWeights(n, steps, divisor=total / world, estimate=1.0, sharded=True)


def _per_sample(counts: torch.Tensor | None) -> list[float] | None:
    """The label counts as numbers, read once: a tensor of the global batch's length would stay allocated
    through every micro-batch, above the peak the trials measured on one micro-batch's worth of samples."""
    return None if counts is None else counts.tolist()
