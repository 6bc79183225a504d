"""Exact gradient accumulation: how micro-batch losses are weighted so the sum of their gradients is the
full-batch gradient, for losses that are means over samples and for token losses `(loss_sum, count)`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import InvalidSetting
from .losses import LossFn, LossForm, LossPart, chunked_default_loss, is_default, loss_parts, model_loss


class LossWeights:
    """Weights that make the sum of micro-batch gradients equal the full-batch gradient.

    Mean losses: micro-batch i of n_i samples out of N contributes (n_i / N) x its loss, with N known
    before the first micro-batch. Token losses, `(loss_sum, count)`: each loss_sum is divided by the
    batch's total count. Where that total is known before the first micro-batch (`total`: the label
    tokens of a Hugging Face batch, counted up front) it is used directly, so the weights carry no
    rounding of the model's own (a float32 norm inside a float64 model); otherwise the first
    count x the number of micro-batches is an estimate (which keeps the gradients' magnitude near a mean
    loss's, as 16-bit ranges want) and `correct` multiplies the gradients by estimate / total at the end.
    Exact either way, because the gradient is linear in the weights. Counts are kept in float64 so that
    summing them is exact, and on the host when they came from the host: a Python number put on the device
    is a copy from pageable memory, which waits for everything queued before it. Two of those per
    micro-batch would drain the device's queue twice a micro-batch (benchmarks/profile_step.py finds such
    waits), so the host's launches would stop overlapping the device's work; a 0-dim host tensor in an operation with
    a device tensor goes in as a scalar argument, no copy.

    A loss of named parts (`weigh_parts`) is weighted part by part: the `(loss_sum, count)` part as above,
    the means over samples by n_i / N. Exact when the total count is known up front; with an estimate, the
    one factor of `correct` (or of `share`, over ranks) rescales every part, so the means end up off by
    estimate / total, which `inexact` says. A model's own loss on labels is weighted whole by its tokens'
    share, per-batch terms (a MoE's router loss) included: each term then accumulates as the share-weighted
    mean of the micro-batches' values.
    """

    def __init__(self, n: int, steps: int, *, divisor: float | None = None, estimate: float | None = None,
                 total: float | None = None, summed: bool = False, sharded: bool = False) -> None:
        self.n = n
        self.steps = steps
        # What mean losses are weighted by (n_i / divisor) and token losses divided by. Default: this
        # batch's samples, and an estimate from the first count. Under torch.distributed the step passes
        # the global samples and tokens, summed over ranks before the first micro-batch; under FSDP, which
        # averages gradients over ranks as it reduces them, every rank passes (global samples / world, 1).
        self.divisor = float(n) if divisor is None else divisor
        self.total = total  # the token count of the whole (global) batch, when known up front
        self.summed = summed  # divisor and total are the global batch's, summed over ranks up front
        self.sharded = sharded  # FSDP: token sums are divided by the global count only after the last backward
        self.labelled = True  # every token count so far is the one counted from the labels up front
        self.by_tokens: bool | None = None
        self.loss_total: torch.Tensor | None = None  # sum of n_i x loss_i, or of loss_sum_i
        self.count_total: torch.Tensor | None = None
        self.mean_total: torch.Tensor | None = None  # sum of n_i x the means beside a (loss_sum, count) part
        self.parts: tuple[tuple[str, bool], ...] | None = None  # (name, counted) of each part of a loss_fn's mapping
        self.estimate: torch.Tensor | None = None if estimate is None else torch.tensor(estimate, dtype=torch.float64)

    def carry_totals(self, device: torch.device) -> None:
        """Start the running totals at zero on `device`, as a step holds them through every micro-batch after its
        first: a trial of one micro-batch then holds what such a micro-batch holds (two 8-byte scalars)."""
        self.loss_total = torch.zeros((), dtype=torch.float64, device=device)
        self.count_total = torch.zeros((), dtype=torch.float64, device=device)

    def weigh(self, loss: torch.Tensor, count: Any, size: int, *, expected: float | None = None,
              mean: bool = False, labelled: bool = False) -> torch.Tensor | None:
        """The loss to call backward on for a micro-batch of `size` samples; None when it adds nothing.

        `count` None: `loss` is a mean over samples. Else `loss` is a sum over `count` tokens, or with
        `mean=True` their mean (the default loss on Hugging Face labels). `expected` is the count this
        micro-batch's labels hold: when the loss counts the same, the known `total` is the divisor.
        `labelled`: `count` is `expected` itself (the default loss), so it matches without being read.
        """
        by_tokens = count is not None
        if self.by_tokens is not None and by_tokens != self.by_tokens:
            raise InvalidSetting("loss_fn returned (loss_sum, count) for some micro-batches and a plain loss for "
                                 "others; return the same form every time")
        self.by_tokens = by_tokens
        if not by_tokens:
            self._add(loss.detach().double() * size, None)
            return loss * (size / self.divisor)  # scale the loss by its share of the samples
        self.labelled = self.labelled and labelled
        count = _float64(count)
        if self.estimate is None:
            known = self.total is not None and (expected is None or float(count) == float(expected))
            self.labelled = self.labelled and known
            self.estimate = torch.tensor(self.total, dtype=torch.float64) if known else count.clamp(min=1) * self.steps
        if mean:
            if float(count) == 0:  # every label padded: a mean of nothing is NaN, and its share is 0
                self._add(loss.detach().new_zeros(()), count)
                return None
            loss = loss * count  # the mean back to the sum: count / total is this micro-batch's share
        self._add(loss.detach(), count)
        return loss / self.estimate  # float64 division; autograd casts the gradient back to loss's dtype

    def weigh_parts(self, parts: tuple[LossPart, ...], size: int, *,
                    expected: float | None = None) -> torch.Tensor | None:
        """The loss to call backward on for a micro-batch whose `loss_fn` returned `parts` (`loss_parts`).

        The `(loss_sum, count)` part is weighed as by `weigh`, the means over samples by n_i / N beside it.
        """
        form = tuple((p.name, p.count is not None) for p in parts)
        if self.parts is not None and form != self.parts and max(len(form), len(self.parts)) > 1:
            raise InvalidSetting(f"loss_fn returned the parts {_listed(self.parts)} for one micro-batch and "
                                 f"{_listed(form)} for another; return the same parts, each of the same kind, "
                                 "every time")
        self.parts = form
        counted = next((p for p in parts if p.count is not None), None)
        mean = _sum([p.loss for p in parts if p.count is None])
        if counted is None:
            assert mean is not None  # loss_parts never returns no part
            return self.weigh(mean, None, size)
        weighted = self.weigh(counted.loss, counted.count, size, expected=expected)
        if mean is None:
            return weighted
        if self.sharded:
            raise InvalidSetting(
                f"under FSDP2 sharding (plan.sharding='fsdp2') loss_fn's parts cannot mix a (loss_sum, count) "
                f"part ({counted.name!r}) with means over samples: FSDP averages the gradients over ranks inside "
                "backward, before the batch's token count is known. Return every part as a mean over samples, or "
                "the whole loss as one (loss_sum, count)")
        detached = mean.detach().double() * size
        self.mean_total = detached if self.mean_total is None else self.mean_total + detached
        share = mean * (size / self.divisor)  # each mean by its share of the samples, as `weigh` does
        return share if weighted is None else weighted + share

    def weigh_divided(self, loss: torch.Tensor, count: float) -> torch.Tensor:
        """A loss the model already divided by the known `total` (`num_items_in_batch`), or a sum over the batch
        (`LossChoice.by` "sum"): backward as it is."""
        assert self.total is not None  # the step passes num_items_in_batch only when it knows the total
        self.by_tokens = True
        self.estimate = torch.tensor(self.total, dtype=torch.float64)
        self._add(loss.detach().double() * self.total, _float64(count))
        return loss

    def _add(self, loss: torch.Tensor, count: torch.Tensor | None) -> None:
        loss = loss.double()
        self.loss_total = loss if self.loss_total is None else self.loss_total + loss
        if count is not None:
            self.count_total = count if self.count_total is None else self.count_total + count

    def needs_correction(self) -> bool:
        """Whether `correct` will rescale the gradients: known once the last micro-batch was weighed."""
        return self.correction() != 1.0

    def correction(self) -> float:
        """The factor `correct` multiplies the gradients by: estimate / true total count, 1 when it was known."""
        if not self.by_tokens or self.estimate is None or self.count_total is None:
            return 1.0
        # The total was known up front: nothing to rescale (and no rounding added).
        return float(self.estimate / self.count_total.clamp(min=1))

    def correct(self, model: nn.Module) -> None:
        """Token losses only: rescale the accumulated gradients from the estimate to the true total count."""
        if not self.needs_correction():
            return
        assert self.estimate is not None and self.count_total is not None  # needs_correction checked both
        factor = self.estimate / self.count_total.clamp(min=1)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor.to(p.grad.device))

    def inexact(self, factor: float | None = None) -> str | None:
        """Why the means beside a `(loss_sum, count)` part were weighted wrong, when the gradients were
        rescaled by `factor` (`share` over ranks; default `correction`) from an estimated total count; else None."""
        if self.mean_total is None:
            return None
        factor = self.correction() if factor is None else factor
        if factor == 1.0:
            return None
        counted = next(name for name, is_counted in self.parts or () if is_counted)
        return (f"loss_fn's parts mix a (loss_sum, count) part ({counted!r}) with means over samples, and the "
                "batch's total count was not known before its first micro-batch (it is when the count equals "
                "that of a mapping batch's 'labels', -100 ignored): the means' share of the update was off by "
                f"{factor - 1:+.2%}")

    def mean_loss(self) -> torch.Tensor:
        """The loss over the whole batch: mean over samples, or over tokens for `(loss_sum, count)`."""
        assert self.loss_total is not None  # at least one micro-batch ran: split_sizes never returns []
        if self.by_tokens and self.count_total is not None:
            loss = self.loss_total / self.count_total.clamp(min=1)
            return loss if self.mean_total is None else loss + self.mean_total / self.n
        return self.loss_total / self.n

    # -- several ranks: each accumulated its own share; these turn the shares into one global batch --------
    def share_known(self) -> bool:
        """Whether this rank's gradients are its exact share of the global batch's already, so `share` is 1
        without reading the summed totals: the counts were summed over ranks before the first micro-batch
        (`summed`), and every token count is the labels' (mean losses need nothing more). Reading them on
        the host would wait for the device before the last backward (replicated ranks, distributed.py)."""
        return self.summed and (not self.by_tokens or self.labelled)

    def totals(self, device: torch.device) -> torch.Tensor:
        """(samples, tokens, loss total, means total) of this rank as float64, to be summed over ranks. Host
        figures go to the device from pinned memory, asynchronously: from pageable memory the copy would wait
        for the device."""
        assert self.loss_total is not None
        count = (self.count_total if self.by_tokens and self.count_total is not None
                 else torch.zeros((), dtype=torch.float64))
        means = self.mean_total if self.mean_total is not None else torch.zeros((), dtype=torch.float64)
        if count.device.type == "cpu":
            head = torch.tensor([float(self.n), float(count)], dtype=torch.float64)
            if device.type == "cuda":
                head = head.pin_memory().to(device, non_blocking=True)
            return torch.cat([head.to(device), self.loss_total.to(device).reshape(1), means.to(device).reshape(1)])
        return torch.stack([torch.tensor(float(self.n), dtype=torch.float64).to(device), count.double().to(device),
                            self.loss_total.to(device), means.double().to(device)])

    def share(self, totals: torch.Tensor) -> float:
        """The factor that turns this rank's accumulated gradients into its share of the global gradient.

        `totals` is `totals()` summed over ranks. Mean losses were weighted by n_i / divisor, so divisor / N
        (all ranks' samples) rescales them: 1 when the divisor was N already. Token losses were divided by
        the estimate, so estimate / (all ranks' tokens): 1 when the total was known up front. Summing the rescaled
        gradients over ranks gives the full-batch one.
        """
        samples, tokens = totals.tolist()[:2]
        if self.by_tokens and self.estimate is not None:
            return float(self.estimate) / max(tokens, 1.0)
        return self.divisor / samples

    def global_mean_loss(self, totals: torch.Tensor) -> torch.Tensor:
        """The loss over the whole global batch, from `totals()` summed over ranks."""
        samples, tokens, loss, means = totals.double().unbind()
        if self.by_tokens:
            return loss / tokens.clamp(min=1) + means / samples
        return loss / samples


def _float64(count: Any) -> torch.Tensor:
    """A count as a float64 tensor where it already is: a device tensor stays (a loss_fn's own count),
    a Python number becomes a host scalar (see `LossWeights`)."""
    if isinstance(count, torch.Tensor):
        return count.detach().to(torch.float64)
    return torch.tensor(float(count), dtype=torch.float64)


def _sum(losses: list[torch.Tensor]) -> torch.Tensor | None:
    total = None
    for loss in losses:
        total = loss if total is None else total + loss
    return total


def _listed(form: tuple[tuple[str, bool], ...]) -> str:
    return "{" + ", ".join(f"{name}: {'(loss_sum, count)' if counted else 'mean'}" for name, counted in form) + "}"


def weighted_loss(loss_fn: LossFn, model: nn.Module, micro: Any, weights: LossWeights, size: int, *,
                  expected: float | None = None, form: LossForm | None = None) -> torch.Tensor | None:
    """One micro-batch's loss, weighted so that the accumulated gradient is the full batch's; None when
    it adds nothing (every label padded).

    `expected` is the micro-batch's label-token count (`label_counts`), None without labels or where the
    loss is a mean over samples. The default loss on labels is a token mean: weighted by its tokens' share of
    the total, or, where `form.num_items` (the model's forward takes `num_items_in_batch`), computed by the
    model as a sum over that total. A `loss_fn`'s return is weighted part by part (`weigh_parts`), except a
    scalar a check found to be a mean over the label tokens (`form.by` "tokens"), weighted by their share.
    """
    form = form if form is not None else LossForm(num_items=False)
    if is_default(loss_fn):
        return _weighted_model_loss(loss_fn, model, micro, weights, size, expected, form)
    value = loss_fn(model, micro)
    if form.by == "tokens" and expected is not None and isinstance(value, torch.Tensor):
        return weights.weigh(value, expected, size, expected=expected, mean=True, labelled=True)
    return weights.weigh_parts(loss_parts(value), size, expected=expected)


def _weighted_model_loss(loss_fn: LossFn, model: nn.Module, micro: Any, weights: LossWeights, size: int,
                         expected: float | None, form: LossForm) -> torch.Tensor | None:
    chunked = loss_fn is chunked_default_loss
    if expected is None:  # no labels: the model's loss is a mean over samples
        out = model_loss(model, micro, chunked=chunked)
        form.learn(out)
        return weights.weigh(out.loss, None, size)
    if form.by == "sum" and weights.total is not None:  # a sum over the batch: each micro-batch's added whole
        out = model_loss(model, micro, chunked=chunked)
        form.learn(out)
        return weights.weigh_divided(out.loss, expected)
    divided = form.num_items and weights.total is not None
    out = model_loss(model, micro, weights.total if divided else None, chunked=chunked)
    if divided and (out.terms or out.hidden):
        # The model added a per-batch term whole to a token sum it divided by the total: this micro-batch is
        # computed again as a mean, weighted by its share, and so is every later one (`form` learns it).
        form.learn(out)
        del out
        out = model_loss(model, micro, chunked=chunked)
        divided = False
    form.learn(out)
    if divided:
        return weights.weigh_divided(out.loss, expected)
    return weights.weigh(out.loss, expected, size, expected=expected, mean=True, labelled=True)
