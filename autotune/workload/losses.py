"""Turning a model and a batch into a loss: the user's `loss_fn`, or the model's own output.

A `loss_fn(model, batch)` returns a scalar loss (mean over the batch's samples), or `(loss_sum, count)`
for losses averaged over tokens with padding, where the step weights by `count` across micro-batches.

The default loss (`loss_fn=None`) follows the Hugging Face convention: with integer `labels` in a mapping
batch, the model's `.loss` is a mean over the label tokens that count (not -100; a causal LM predicts
token t+1 from token t, so its first label never counts). Such a loss is a token loss: `label_counts`
counts those tokens per sample before the first micro-batch, and the step weights each micro-batch's
mean by its share of the whole batch's tokens, or passes the total as `num_items_in_batch` to a model
whose loss honours it (`takes_num_items`), so its loss is already the sum over the total, as Hugging
Face's Trainer does since transformers PR #34191. Without labels the
default loss is a mean over samples.

With "chunked_loss" allowed (the default) and a Hugging Face causal LM whose head allows it, the default
loss is `chunked_default_loss`: the same loss with the head's logits computed a chunk of tokens at a time
(`chunked_loss.py` says why and what changes).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import InvalidSetting
from . import chunked_loss

LossFn = Callable[[torch.nn.Module, Any], Any]

IGNORE_INDEX = -100  # Hugging Face's (and torch's cross_entropy's) label for "no loss here"


def call_model(model: torch.nn.Module, batch: Any, **extra: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch, **extra)
    if isinstance(batch, (list, tuple)):
        return model(*batch, **extra)
    return model(batch, **extra)


def default_loss(model: torch.nn.Module, batch: Any, num_items_in_batch: float | None = None) -> torch.Tensor:
    """`output.loss` (Hugging Face style), `output["loss"]`, or the output itself when it is a scalar.

    `num_items_in_batch` is passed on to the model only when given (see `takes_num_items`).
    """
    extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
    try:
        out = call_model(model, batch, **extra)
    except TypeError as exc:
        _explain_unpacking(model, batch, exc)
        raise
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None and isinstance(out, torch.Tensor) and out.dim() == 0:
        loss = out
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise InvalidSetting(
            "loss_fn: the model's output has no scalar loss (no .loss, no ['loss'], not a 0-dim tensor); pass "
            "loss_fn=lambda model, batch: ... returning a scalar, e.g. "
            "loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])")
    return loss


def chunked_default_loss(model: torch.nn.Module, batch: Any, num_items_in_batch: float | None = None) -> torch.Tensor:
    """`default_loss` with the head's logits and loss computed a chunk of tokens at a time (batches with labels)."""
    if not (isinstance(batch, Mapping) and batch.get("labels") is not None):
        return default_loss(model, batch, num_items_in_batch)
    with chunked_loss.chunked(model):
        return default_loss(model, batch, num_items_in_batch)


def is_default(loss_fn: LossFn) -> bool:
    """Whether `loss_fn` is the model's own loss (either way of computing it): then labels weigh by tokens."""
    return loss_fn is default_loss or loss_fn is chunked_default_loss


def _explain_unpacking(model: torch.nn.Module, batch: Any, exc: TypeError) -> None:
    """An `(x, y)` batch the model's forward cannot take as `model(x, y)`: say so, and what loss_fn to pass.

    Only a call the forward's signature refuses is explained; a `TypeError` raised inside a forward that
    accepted its arguments is the model's own and goes on untouched.
    """
    if not isinstance(batch, (list, tuple)):
        return
    try:
        inspect.signature(model.forward).bind(*batch)
    except TypeError:
        kinds = ", ".join(type(b).__name__ for b in batch)
        raise InvalidSetting(
            f"loss_fn: the batch is a {type(batch).__name__} of {len(batch)} ({kinds}), so the default loss calls "
            f"model(*batch), which {type(model).__name__}.forward does not take ({exc}). Pass a loss_fn, e.g. "
            "loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), or a dict batch whose keys "
            "the model takes and whose output has .loss (Hugging Face style)") from exc
    except ValueError:  # no signature to read (a builtin): nothing to add
        return


def resolve(loss_fn: LossFn | None, model: torch.nn.Module | None = None, *, chunked: bool = False) -> LossFn:
    """The loss to call: the user's, else the model's own, chunked when allowed (`chunked`) and `model` takes it."""
    if loss_fn is None:
        return chunked_default_loss if chunked and model is not None and chunked_loss.why_not(model) is None \
            else default_loss
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


# -- token counts of Hugging Face labels -----------------------------------------------------------------

def label_counts(model: torch.nn.Module, batch: Any) -> torch.Tensor | None:
    """Per sample, the label tokens a Hugging Face loss averages over (float64, shape (B,)), or None.

    None when the batch is not a mapping with an integer `labels` tensor: then the default loss is a mean
    over samples. Labels of shape (B,) (sequence classification) count 1 per sample unless -100.
    """
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor) or labels.dim() == 0 or labels.is_floating_point() \
            or labels.dtype == torch.bool:
        return None
    if labels.dim() >= 2 and is_causal_lm(model):
        labels = labels[:, 1:]  # position t's label is predicted from token t-1: the first never counts
    counted = (labels != IGNORE_INDEX).reshape(labels.shape[0], -1)
    return counted.sum(dim=1).to(torch.float64).cpu()


def is_causal_lm(model: torch.nn.Module) -> bool:
    """Whether a Hugging Face model shifts its labels by one inside its loss (a causal language model)."""
    model = chunked_loss.unwrapped(model)
    loss_type = getattr(model, "loss_type", None)
    if isinstance(loss_type, str):
        return loss_type == "ForCausalLM"
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    name = type(model).__name__
    return name.endswith(("ForCausalLM", "LMHeadModel"))  # GPT-2 has no loss_type but a causal loss


def takes_num_items(model: torch.nn.Module) -> bool:
    """Whether the model's loss honours `num_items_in_batch` (then its loss is a sum over that number).

    Yes when `forward` names the parameter, or when it is a Hugging Face model whose `forward` takes
    `**kwargs` and hands them to `self.loss_function` (Llama, GPT-2: every such loss takes it). A bare
    `**kwargs` is not enough: T5 accepts and ignores it (its loss stays a mean), which would make the step
    weigh a mean as a sum. Models that do not honour it get their mean weighted by its token count: the
    same gradient, up to the rounding of a loss the model computes in float32.
    """
    model = chunked_loss.unwrapped(model)
    forward = getattr(type(model), "forward", None)
    try:
        params = inspect.signature(forward).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    if "num_items_in_batch" in params:
        return True
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return False
    if getattr(model, "accepts_loss_kwargs", True) is False:
        return False
    try:
        return "self.loss_function(" in inspect.getsource(forward)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False
