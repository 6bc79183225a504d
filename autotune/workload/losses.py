"""Turning a model and a batch into a loss: the user's `loss_fn`, or the model's own output.

A `loss_fn(model, batch)` returns a scalar loss (mean over the batch's samples), `(loss_sum, count)`
for losses averaged over tokens with padding, where the step weights by `count` across micro-batches, or
a mapping of named parts, each one of those two (at most one `(loss_sum, count)`): the step weights each
part by its own kind, so a token mean plus a per-sample regularizer accumulates exactly (`loss_parts`).

The default loss (`loss_fn=None`) follows the Hugging Face convention: with integer `labels` in a mapping
batch, the model's `.loss` is a mean over the label tokens that count (not -100; a causal LM predicts
token t+1 from token t, so its first label never counts). Such a loss is a token loss: `label_counts`
counts those tokens per sample before the first micro-batch, and the step weights each micro-batch's
mean by its share of the whole batch's tokens, or passes the total as `num_items_in_batch` to a model
whose loss honours it (`takes_num_items`), so its loss is already the sum over the total, as Hugging
Face's Trainer does since transformers PR #34191. Without labels the
default loss is a mean over samples.

A Hugging Face mixture-of-experts model with `output_router_logits` adds `router_aux_loss_coef x aux_loss`
(a load-balancing loss over the batch's routing) to that token mean; `model_loss` finds it (`ModelLoss.terms`).
Such a loss is weighted whole by the micro-batch's token share and never divided by `num_items_in_batch`
(the model would add its term whole to a sum already divided by the total), so the accumulated term is the
share-weighted mean of the micro-batches' values however many micro-batches there are (Megatron-Core takes
an unweighted mean; docs/moe-router-loss.md compares the conventions). A term the loss holds with no known
coefficient (another output field ending in `_loss`, Bamba's z-loss) is weighted the same way and said in
`LossForm.note`.

With "chunked_loss" allowed (the default) and a Hugging Face causal LM whose head allows it, the default
loss is `chunked_default_loss`: the same loss with the head's logits computed a chunk of tokens at a time
(`chunked_loss.py` says why and what changes).

Both substitutes, the chunked loss and the weighting of micro-batches, are checked on the user's model and
example batch before they are used (`loss_checks.py`); what the check found for a model is its `LossChoice`,
which `resolve`, `label_counts` and `LossForm` follow (`loss_choice.py`). Until a check ran, the choice is the one
above.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidSetting
from . import chunked_loss
from .loss_choice import LossFn, chosen, recorded_choice, takes_num_items


def call_model(model: torch.nn.Module, batch: Any, **extra: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch, **extra)
    if isinstance(batch, (list, tuple)):
        return model(*batch, **extra)
    return model(batch, **extra)


@dataclass(frozen=True, slots=True)
class ModelLoss:
    """The model's own loss, and the per-batch terms it holds besides its per-token (or per-sample) mean."""

    loss: torch.Tensor  # `output.loss` as the model returned it
    terms: tuple[str, ...] = ()  # per-batch terms inside `loss` with a known coefficient (a MoE's aux_loss)
    hidden: tuple[str, ...] = ()  # other terms the output names, which autotune cannot tell apart from the rest
    per_batch: torch.Tensor | float = 0.0  # the sum of coefficient x term over `terms`: what `loss` adds to its mean


# Where Hugging Face MoE models keep the weight of `aux_loss` in their loss: on the model (Mixtral, Qwen2-MoE,
# DBRX, JetMoE...), else on its config or its text config (vision-language MoEs).
AUX_COEFFICIENTS = ("router_aux_loss_coef", "aux_loss_coef")


def model_loss(model: torch.nn.Module, batch: Any, num_items_in_batch: float | None = None, *,
               chunked: bool = False) -> ModelLoss:
    """The model's loss (`output.loss`, `output["loss"]`, or a scalar output) and the terms inside it.

    `num_items_in_batch` is passed on to the model only when given (see `takes_num_items`); `chunked`
    computes the head and its loss a chunk of tokens at a time (batches with labels; `chunked_loss.py`).
    """
    extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
    labelled = isinstance(batch, Mapping) and batch.get("labels") is not None
    context = chunked_loss.chunked(model) if chunked and labelled else contextlib.nullcontext()
    try:
        with context:
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
        raise MissingLoss("the model's output has no scalar loss (no .loss, no ['loss'], not a 0-dim tensor)")
    return _with_terms(model, out, loss)


def default_loss(model: torch.nn.Module, batch: Any, num_items_in_batch: float | None = None) -> torch.Tensor:
    """`output.loss` (Hugging Face style), `output["loss"]`, or the output itself when it is a scalar.

    `num_items_in_batch` is passed on to the model only when given (see `takes_num_items`).
    """
    return model_loss(model, batch, num_items_in_batch).loss


def chunked_default_loss(model: torch.nn.Module, batch: Any, num_items_in_batch: float | None = None) -> torch.Tensor:
    """`default_loss` with the head's logits and loss computed a chunk of tokens at a time (batches with labels)."""
    return model_loss(model, batch, num_items_in_batch, chunked=True).loss


def _with_terms(model: torch.nn.Module, out: Any, loss: torch.Tensor) -> ModelLoss:
    """`loss` with the per-batch terms the output names: `aux_loss` with a known coefficient is a term (the
    model added coefficient x aux_loss to its loss); any other 0-dim `*_loss` field is `hidden`."""
    fields = [k for k, v in out.items() if k != "loss" and k.endswith("_loss") and isinstance(v, torch.Tensor)
              and v.dim() == 0] if isinstance(out, Mapping) else []
    coefficient = aux_coefficient(model)
    terms = tuple(k for k in fields if k == "aux_loss" and coefficient is not None)
    per_batch = sum((coefficient * out[k].detach() for k in terms), 0.0) if coefficient is not None else 0.0
    return ModelLoss(loss=loss, terms=terms, hidden=tuple(k for k in fields if k not in terms), per_batch=per_batch)


def aux_coefficient(model: torch.nn.Module) -> float | None:
    """The weight a Hugging Face MoE model gives its `aux_loss` inside `.loss`, or None where it has none."""
    model = chunked_loss.unwrapped(model)
    config = getattr(model, "config", None)
    for owner in (model, config, getattr(config, "text_config", None)):
        for name in AUX_COEFFICIENTS:
            value = getattr(owner, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    return None


def hidden_terms(model: torch.nn.Module) -> tuple[str, ...]:
    """Terms the model adds to its loss without returning them: Bamba's `z_loss_coefficient x z_loss`."""
    coefficient = getattr(chunked_loss.unwrapped(model), "z_loss_coefficient", 0)
    return ("z_loss",) if isinstance(coefficient, (int, float)) and coefficient > 0 else ()


def routes_with_loss(model: torch.nn.Module) -> bool:
    """Whether the model's config turns its router loss on (`output_router_logits`, Hugging Face MoEs)."""
    config = getattr(chunked_loss.unwrapped(model), "config", None)
    configs = (config, getattr(config, "text_config", None))
    return any(getattr(c, "output_router_logits", False) is True for c in configs)


@dataclass(kw_only=True, slots=True)
class LossForm:
    """What a step (or a search) knows about the model's own loss, kept across its micro-batches and steps.

    `num_items`: pass `num_items_in_batch` to the model (`takes_num_items`); off for a loss that holds a
    per-batch term, which a model dividing its token sum by the total would add whole in every micro-batch:
    off from the start where the config says so, else once such a term is met. `note` says, once, what
    could not be told apart (for `plan.reason` and a warning).
    """

    num_items: bool
    note: str | None = None
    by: str = "returned"  # how a `loss_fn`'s scalar is weighted: `LossChoice.by`

    @classmethod
    def of(cls, model: torch.nn.Module) -> LossForm:
        hidden = hidden_terms(model)
        choice = chosen(model)
        return cls(num_items=choice.num_items and takes_num_items(model) and not hidden and not routes_with_loss(model),
                   note=_unseparable(hidden) if hidden else None, by=choice.by)

    def learn(self, loss: ModelLoss) -> None:
        """Stop dividing by the total once `loss` holds a per-batch term; note those it cannot tell apart."""
        if loss.terms or loss.hidden:
            self.num_items = False
        if loss.hidden and self.note is None:
            self.note = _unseparable(loss.hidden)


def _unseparable(names: tuple[str, ...]) -> str:
    listed = ", ".join(names)
    return (f"the model's loss also holds {listed}, which autotune cannot tell apart from the rest of it (no known "
            "coefficient): the whole loss is weighted by each micro-batch's share of the batch, so "
            f"{listed} counts as the share-weighted mean of the micro-batches' values")


def is_default(loss_fn: LossFn) -> bool:
    """Whether `loss_fn` is the model's own loss (either way of computing it): then labels weigh by tokens."""
    return loss_fn is default_loss or loss_fn is chunked_default_loss


FIT_CALL = "autotune.fit(model, batch, loss_fn=...), and plan.apply trains with it too"
APPLY_CALL = "plan.apply(model, optimizer, loss_fn=...)"


class MissingLoss(InvalidSetting):
    """The default loss found no loss to train on; the message says what loss_fn to write and which call takes
    it: `autotune.fit` while tuning, `plan.apply` in training (`passed_to`)."""

    def __init__(self, problem: str, where: str = FIT_CALL, otherwise: str = "") -> None:
        super().__init__(problem, where, otherwise)  # every part in args, so the error pickles whole
        self.problem, self.where, self.otherwise = problem, where, otherwise

    def __str__(self) -> str:
        return (f"loss_fn: {self.problem}. Write a loss_fn(model, batch) returning a scalar, e.g. lambda m, b: "
                f"torch.nn.functional.cross_entropy(m(b[0]), b[1]), and pass it to {self.where}{self.otherwise}")

    def passed_to(self, where: str) -> MissingLoss:
        return MissingLoss(self.problem, where, self.otherwise)


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
        raise MissingLoss(
            f"the batch is a {type(batch).__name__} of {len(batch)} ({kinds}), so the default loss calls "
            f"model(*batch), which {type(model).__name__}.forward does not take ({exc})",
            otherwise="; or give a dict batch whose keys the model takes and whose output has .loss "
            "(Hugging Face style)") from exc
    except ValueError:  # no signature to read (a builtin): nothing to add
        return


def resolve(loss_fn: LossFn | None, model: torch.nn.Module | None = None, *, chunked: bool = False) -> LossFn:
    """The loss to call: the user's, else the model's own, chunked when allowed (`chunked`), `model` takes it and
    no check on an example batch found the chunked loss to differ from the model's own (`LossChoice.chunked`)."""
    if loss_fn is None:
        if not chunked or model is None or chunked_loss.why_not(model) is not None:
            return default_loss
        checked = recorded_choice(model, None)
        return chunked_default_loss if checked is None or checked.chunked else default_loss
    if not callable(loss_fn):
        raise InvalidSetting(f"loss_fn must be callable (model, batch) -> loss, got {type(loss_fn).__name__}")
    return loss_fn


def split_loss(value: Any) -> tuple[torch.Tensor, torch.Tensor | float | None]:
    """(loss, count): count is None for a plain mean loss, else the number the sum was taken over."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return value[0], value[1]
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value, None
    raise InvalidSetting(f"loss_fn returned {type(value).__name__}; return a scalar tensor, (loss_sum, count), "
                         "or a mapping of named parts, each one of those")


@dataclass(frozen=True, slots=True)
class LossPart:
    """One named part of a `loss_fn`'s loss: a mean over samples (`count` None), or a sum over `count` items."""

    name: str
    loss: torch.Tensor
    count: torch.Tensor | float | None


def loss_parts(value: Any) -> tuple[LossPart, ...]:
    """A `loss_fn`'s return as its parts: one for a scalar or `(loss_sum, count)`, one a key for a mapping."""
    if not isinstance(value, Mapping):
        return (LossPart("loss", *split_loss(value)),)
    if not value:
        raise InvalidSetting("loss_fn returned an empty mapping; return at least one named part")
    parts = tuple(LossPart(str(name), *_split_part(name, part)) for name, part in value.items())
    counted = [p.name for p in parts if p.count is not None]
    if len(counted) > 1:
        raise InvalidSetting(f"loss_fn returned {len(counted)} (loss_sum, count) parts ({', '.join(counted)}); "
                             "at most one part may be a sum over a count: return the others as means over samples")
    return parts


def _split_part(name: Any, part: Any) -> tuple[torch.Tensor, torch.Tensor | float | None]:
    try:
        return split_loss(part)
    except InvalidSetting:
        raise InvalidSetting(f"loss_fn's part {name!r} is a {type(part).__name__}; each part must be a scalar "
                             "tensor (a mean over samples) or (loss_sum, count)") from None


def full_batch_loss(value: Any) -> torch.Tensor:
    """A `loss_fn`'s return as one scalar, the loss of the batch it was computed on: sums divided by counts."""
    total = None
    for part in loss_parts(value):
        loss = part.loss if part.count is None else part.loss / part.count
        total = loss if total is None else total + loss
    assert total is not None  # loss_parts never returns no part
    return total
