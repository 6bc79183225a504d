"""How micro-batches of one loss are weighted to give the whole batch's: the `LossChoice` a check on the
example batch found for a model (`loss_checks.py`), the labels it counts, and whether the model may be passed
the batch's total as `num_items_in_batch`.

Until a check ran for a model, its choice is Hugging Face's convention: integer `labels`, -100 counts for
nothing, and a causal LM's first label of each sequence never counts (`LossChoice.default`).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import chunked_loss
from .chunked_loss import IGNORE_INDEX

# A loss: the model and a batch in, the loss out (`losses.py` resolves the user's, or the model's own)
LossFn = Callable[[torch.nn.Module, Any], Any]

__all__ = ["IGNORE_INDEX", "LossChoice", "LossFn", "chosen", "int_labels", "is_causal_lm", "label_counts",
           "record_choice", "recorded_choice", "takes_num_items"]

WEIGHTINGS = ("tokens", "samples", "returned", "sum")


@dataclass(frozen=True, kw_only=True, slots=True)
class LossChoice:
    """How autotune computes a model's loss over micro-batches: what a check on an example batch found
    (`loss_checks.py`), or, before one ran, what the model's kind suggests (`LossChoice.default`).

    by: how each micro-batch's loss is weighted. "tokens": it is a mean over the label tokens `ignore_index`
        and `shifted` count, weighted by its share of the batch's tokens; "samples": a mean over samples,
        weighted by its share of the samples; "sum": a sum over the batch (CTC's "sum" reduction), each
        micro-batch's loss added whole; "returned": as the loss says itself (the model's own loss on
        integer labels by tokens, else by samples; a `loss_fn`'s scalar by samples, its `(loss_sum, count)` by
        the count, its named parts part by part).
    ignore_index: the label value that counts for nothing (Hugging Face's -100; Segformer's 255).
    shifted: the first label of each sequence counts for nothing (a causal LM predicts token t+1 from token t).
    num_items: the model may be passed `num_items_in_batch` (where `takes_num_items`): its loss is then the sum
        over that total.
    chunked: the chunked loss may stand in for the model's own (`resolve`).
    """

    by: str = "returned"
    ignore_index: int = IGNORE_INDEX
    shifted: bool = False
    num_items: bool = True
    chunked: bool = True

    def __post_init__(self) -> None:
        if self.by not in WEIGHTINGS:
            raise ValueError(f"by must be one of {WEIGHTINGS}, got {self.by!r}")

    @classmethod
    def default(cls, model: torch.nn.Module) -> LossChoice:
        """Before a check: Hugging Face's convention (-100 ignored, a causal LM's first label left out)."""
        return cls(shifted=is_causal_lm(model))

    def counts(self, labels: torch.Tensor) -> torch.Tensor:
        """Per sample, the labels that count (float64 on the host, shape (B,)); a (B,) tensor counts 1 a sample."""
        if labels.dim() == 2 and self.shifted:
            labels = labels[:, 1:]  # position t's label is predicted from token t-1: the first never counts
        counted = (labels != self.ignore_index).reshape(labels.shape[0], -1)
        return counted.sum(dim=1).to(torch.float64).cpu()

    def describe(self) -> str:
        """The weighting in words, for a plan's reason."""
        if self.by == "samples":
            return "by samples (the loss is a mean over samples)"
        if self.by == "returned":
            return "by what the loss returns"
        if self.by == "sum":
            return "as a sum (the loss is a sum over the batch: each micro-batch's added whole)"
        first = ", the first of each sequence left out" if self.shifted else ""
        return f"by label tokens (labels other than {self.ignore_index}{first})"


def int_labels(batch: Any) -> torch.Tensor | None:
    """The batch's integer `labels` tensor (a mapping batch, one or more dimensions), else None."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor) or labels.dim() == 0 or labels.is_floating_point() \
            or labels.is_complex() or labels.dtype == torch.bool:
        return None
    return labels


def label_counts(model: torch.nn.Module, batch: Any) -> torch.Tensor | None:
    """Per sample, the label tokens the model's loss averages over (float64, shape (B,)), or None.

    None when the batch is not a mapping with an integer `labels` tensor, or where the loss was found to be a
    mean over samples (`LossChoice.by`): then micro-batches are weighted by their samples. Which labels count
    is the model's `LossChoice`: Hugging Face's -100 and causal shift, unless a check found otherwise. Labels
    of shape (B,) (sequence classification) count 1 per sample unless ignored.
    """
    labels = int_labels(batch)
    if labels is None:
        return None
    choice = chosen(model)
    return None if choice.by == "samples" else choice.counts(labels)


def is_causal_lm(model: torch.nn.Module) -> bool:
    """Whether a Hugging Face model shifts its labels by one inside its loss (a causal language model, or a
    vision-language model whose loss is the causal LM's: LLaVA's `ForConditionalGeneration`)."""
    model = chunked_loss.unwrapped(model)
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    loss = chunked_loss.hf_loss_name(model, fallback=False)
    if loss is not None:
        return loss == chunked_loss.CAUSAL_LOSS
    name = type(model).__name__
    return name.endswith(("ForCausalLM", "LMHeadModel"))  # GPT-2 has no loss_type but a causal loss


# What a check found for each model, for the loss_fn it was made with (None: the model's own loss). Weak on
# the model and, where it takes one, on the loss_fn: a dead loss_fn matches nothing.
_CHOICES: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Callable[[], Any] | None, LossChoice]] = \
    weakref.WeakKeyDictionary()


def record_choice(model: torch.nn.Module, loss_fn: LossFn | None, choice: LossChoice) -> None:
    """Record `choice` as what a check found for `model` trained on `loss_fn` (None: its own loss)."""
    _CHOICES[chunked_loss.unwrapped(model)] = (None if loss_fn is None else _weakly(loss_fn), choice)


def recorded_choice(model: torch.nn.Module, loss_fn: LossFn | None) -> LossChoice | None:
    """What a check found for `model` trained on `loss_fn`, or None where none was made for that loss_fn."""
    held = _CHOICES.get(chunked_loss.unwrapped(model))
    if held is None:
        return None
    ref, choice = held
    same = loss_fn is None if ref is None else loss_fn is not None and ref() is loss_fn
    return choice if same else None


def chosen(model: torch.nn.Module) -> LossChoice:
    """The choice last recorded for `model`, else `LossChoice.default`."""
    held = _CHOICES.get(chunked_loss.unwrapped(model))
    return held[1] if held is not None else LossChoice.default(model)


def _weakly(fn: Any) -> Callable[[], Any]:
    if inspect.ismethod(fn):
        return weakref.WeakMethod(fn)
    try:
        return weakref.ref(fn)
    except TypeError:  # an object that takes no weak reference: held (as the plan `fit` returns holds its loss)
        return lambda: fn


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
