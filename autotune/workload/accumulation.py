"""Exact gradient accumulation: how micro-batch losses are weighted so the sum of their gradients is the
full-batch gradient (DESIGN.md section 1, "Exact accumulation"; PEERS.md lesson 9 for token losses).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import InvalidSetting
from .losses import LossFn, is_default, split_loss


class LossWeights:
    """Weights that make the sum of micro-batch gradients equal the full-batch gradient.

    Mean losses: micro-batch i of n_i samples out of N contributes (n_i / N) x its loss, with N known
    before the first micro-batch. Token losses, `(loss_sum, count)`: each loss_sum is divided by the
    batch's total count. Where that total is known before the first micro-batch (`total`: the label
    tokens of a Hugging Face batch, counted up front) it is used directly, so the weights carry no
    rounding of the model's own (a float32 norm inside a float64 model, issue 17); otherwise the first
    count x the number of micro-batches is an estimate (which keeps the gradients' magnitude near a mean
    loss's, as 16-bit ranges want) and `correct` multiplies the gradients by estimate / total at the end.
    Exact either way, because the gradient is linear in the weights. Counts are kept in float64 so that
    summing them is exact, and on the host when they came from the host: a Python number put on the device
    is a copy from pageable memory, which waits for everything queued before it. Two of those per
    micro-batch drained the device's queue twice a micro-batch (W1 on an H100, benchmarks/profile_step.py),
    so the host's launches stopped overlapping the device's work; a 0-dim host tensor in an operation with
    a device tensor goes in as a scalar argument, no copy.
    """

    def __init__(self, n: int, steps: int, *, divisor: float | None = None, estimate: float | None = None,
                 total: float | None = None, summed: bool = False) -> None:
        self.n = n
        self.steps = steps
        # What mean losses are weighted by (n_i / divisor) and token losses divided by. Default: this
        # batch's samples, and an estimate from the first count. Under torch.distributed the step passes
        # the global samples and tokens, summed over ranks before the first micro-batch; under FSDP, which
        # averages gradients over ranks as it reduces them, every rank passes (global samples / world, 1).
        self.divisor = float(n) if divisor is None else divisor
        self.total = total  # the token count of the whole (global) batch, when known up front
        self.summed = summed  # divisor and total are the global batch's, summed over ranks up front
        self.labelled = True  # every token count so far is the one counted from the labels up front
        self.by_tokens: bool | None = None
        self.loss_total: torch.Tensor | None = None  # sum of n_i x loss_i, or of loss_sum_i
        self.count_total: torch.Tensor | None = None
        self.estimate: torch.Tensor | None = None if estimate is None else torch.tensor(estimate, dtype=torch.float64)

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

    def weigh_divided(self, loss: torch.Tensor, count: float) -> torch.Tensor:
        """A loss the model already divided by the known `total` (`num_items_in_batch`): backward as it is."""
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
        if not self.by_tokens or self.estimate is None or self.count_total is None:
            return False
        # The total was known up front: nothing to rescale (and no rounding added).
        return float(self.estimate / self.count_total.clamp(min=1)) != 1.0

    def correct(self, model: nn.Module) -> None:
        """Token losses only: rescale the accumulated gradients from the estimate to the true total count."""
        if not self.needs_correction():
            return
        factor = self.estimate / self.count_total.clamp(min=1)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor.to(p.grad.device))

    def mean_loss(self) -> torch.Tensor:
        """The loss over the whole batch: mean over samples, or over tokens for `(loss_sum, count)`."""
        assert self.loss_total is not None  # at least one micro-batch ran: split_sizes never returns []
        if self.by_tokens and self.count_total is not None:
            return self.loss_total / self.count_total.clamp(min=1)
        return self.loss_total / self.n

    # -- several ranks: each accumulated its own share; these turn the shares into one global batch --------
    def share_known(self) -> bool:
        """Whether this rank's gradients are its exact share of the global batch's already, so `share` is 1
        without reading the summed totals: the counts were summed over ranks before the first micro-batch
        (`summed`), and every token count is the labels' (mean losses need nothing more). Reading them on
        the host would wait for the device before the last backward (replicated ranks, distributed.py)."""
        return self.summed and (not self.by_tokens or self.labelled)

    def totals(self, device: torch.device) -> torch.Tensor:
        """(samples, tokens, loss total) of this rank as float64, to be summed over ranks. Host figures go to
        the device from pinned memory, asynchronously: from pageable memory the copy would wait for the device."""
        assert self.loss_total is not None
        count = self.count_total if self.by_tokens and self.count_total is not None else torch.zeros((), dtype=torch.float64)
        if count.device.type == "cpu":
            head = torch.tensor([float(self.n), float(count)], dtype=torch.float64)
            if device.type == "cuda":
                head = head.pin_memory().to(device, non_blocking=True)
            return torch.cat([head.to(device), self.loss_total.to(device).reshape(1)])
        return torch.stack([torch.tensor(float(self.n), dtype=torch.float64).to(device), count.double().to(device),
                            self.loss_total.to(device)])

    def share(self, totals: torch.Tensor) -> float:
        """The factor that turns this rank's accumulated gradients into its share of the global gradient.

        `totals` is `totals()` summed over ranks. Mean losses were weighted by n_i / divisor, so divisor / N
        (all ranks' samples) rescales them: 1 when the divisor was N already. Token losses were divided by
        the estimate, so estimate / (all ranks' tokens): 1 when the total was known up front. Summing the rescaled gradients over ranks gives the full-batch one.
        """
        samples, tokens, _ = totals.tolist()
        if self.by_tokens and self.estimate is not None:
            return float(self.estimate) / max(tokens, 1.0)
        return self.divisor / samples

    def global_mean_loss(self, totals: torch.Tensor) -> torch.Tensor:
        """The loss over the whole global batch, from `totals()` summed over ranks."""
        samples, tokens, loss = totals.double().unbind()
        return loss / (tokens.clamp(min=1) if self.by_tokens else samples)


def _float64(count: Any) -> torch.Tensor:
    """A count as a float64 tensor where it already is: a device tensor stays (a loss_fn's own count),
    a Python number becomes a host scalar (see `LossWeights`)."""
    if isinstance(count, torch.Tensor):
        return count.detach().to(torch.float64)
    return torch.tensor(float(count), dtype=torch.float64)


def weighted_loss(loss_fn: LossFn, model: nn.Module, micro: Any, weights: LossWeights, size: int, *,
                  expected: float | None = None, num_items: bool = False) -> torch.Tensor | None:
    """One micro-batch's loss, weighted so that the accumulated gradient is the full batch's; None when
    it adds nothing (every label padded).

    `expected` is the micro-batch's label-token count (`label_counts`), None without labels. The default
    loss on labels is a token mean: weighted by its tokens' share of the total, or, for a model whose
    forward takes `num_items_in_batch` (`num_items`), computed by the model as a sum over that total.
    """
    if is_default(loss_fn) and expected is not None:
        if num_items and weights.total is not None:
            return weights.weigh_divided(loss_fn(model, micro, num_items_in_batch=weights.total), expected)  # type: ignore[call-arg]
        return weights.weigh(loss_fn(model, micro), expected, size, expected=expected, mean=True, labelled=True)
    loss, count = split_loss(loss_fn(model, micro))
    return weights.weigh(loss, count, size, expected=expected)
