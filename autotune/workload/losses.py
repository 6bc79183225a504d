"""Turning a model and a batch into a loss: the user's `loss_fn`, or the model's own output.

A `loss_fn(model, batch)` returns a scalar loss (mean over the batch's samples), or `(loss_sum, count)`
for losses averaged over tokens with padding, where the step weights by `count` across micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import InvalidSetting

LossFn = Callable[[torch.nn.Module, Any], Any]


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)


def default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """`output.loss` (Hugging Face style), `output["loss"]`, or the output itself when it is a scalar."""
    out = call_model(model, batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None and isinstance(out, torch.Tensor) and out.dim() == 0:
        loss = out
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise InvalidSetting(
            "loss_fn: the model's output has no scalar loss (no .loss, no ['loss'], not a 0-dim tensor); pass "
            "loss_fn=lambda model, batch: ... returning a scalar, e.g. "
            "loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])")
    return loss


def resolve(loss_fn: LossFn | None) -> LossFn:
    if loss_fn is None:
        return default_loss
    if not callable(loss_fn):
        raise InvalidSetting(f"loss_fn must be callable (model, batch) -> loss, got {type(loss_fn).__name__}")
    return loss_fn


def split_loss(value: Any) -> tuple[torch.Tensor, torch.Tensor | float | None]:
    """(loss, count): count is None for a plain mean loss, else the number the sum was taken over."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return value[0], value[1]
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value, None
    raise InvalidSetting(f"loss_fn returned {type(value).__name__}; return a scalar tensor or (loss_sum, count)")
