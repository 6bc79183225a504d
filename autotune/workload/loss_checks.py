"""Checks, on the user's model and example batch, that what autotune puts in place of the user's loss computes
the same thing, before it is used.

Two things stand in for the user's computation of the loss: the chunked head (`chunked_loss.py`) for the model's
own loss, and the weighting that makes micro-batches add up to the whole batch (`accumulation.py`). Each is
checked by its value on the example:

- the chunked loss against the model's own on the same samples (a head whose loss is not next-token
  prediction, or a hook that changes the logits, gives another value);
- the weighting against the whole: the example split in two parts, each part's loss weighted by its share must
  give the whole's loss. The shares tried: of the label tokens, counted by the model's own ignore index
  (Hugging Face's -100, Segformer's 255, a pad id) with or without the causal shift; of the samples (a mean
  of per-sequence means, CTC's "mean"); or the `(loss_sum, count)` a `loss_fn` returns. The first that gives
  the whole is used; where passing `num_items_in_batch` is part of it, that is checked too.

A substitute that fails is not used, and `CheckedLoss.notes` say which and why; where no weighting gives the
whole, `CheckedLoss.warning` names the fix (a `loss_fn` returning `(loss_sum, count)`).

The forwards run on a slice of at most `SLICE` samples, in the model's dtype (no autocast), without gradients
and in eval mode: dropout would draw other masks for the parts than for the whole, and BatchNorm's batch
statistics tie the samples together, while their running statistics do not. The modules' train/eval flags, the
buffers, the parameters and the random streams are put back after (`evaluation.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import AutotuneError, is_oom
from . import batch as batches
from . import chunked_loss
from .evaluation import evaluating
from .loss_choice import IGNORE_INDEX, LossChoice, int_labels, is_causal_lm, record_choice, takes_num_items
from .losses import LossFn, hidden_terms, loss_parts, model_loss, routes_with_loss

SLICE = 4  # samples of the example the check runs on: enough for two parts of different token counts
# Relative tolerance of "the same value", by the least precise floating dtype among the model's and the loss's:
# summation order differs between the whole and its parts, and the chunks round where the full logits did.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}
TF32_TOLERANCE = 1e-3  # float32 matmuls on a GPU allowed TF32 (10 bits of mantissa)
FIX = ("return (loss_sum, count) from a loss_fn, the sum of the per-token (or per-sample) losses and the number "
       "it was taken over, and autotune divides by the whole batch's count")

Agree = Callable[[list[bool]], list[bool]]  # each flag True where it is True on every rank
Together = Callable[[], contextlib.AbstractContextManager[Any]]  # around forwards: one rank's error fails every rank's


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckedLoss:
    """What the check found: the choice training follows, and what to say about it.

    `notes` go into `plan.reason` (each a finding of `fit`'s plan, where the reason does not say it yet);
    `warning` (no weighting reproduces the whole batch) is said once.
    """

    choice: LossChoice
    notes: tuple[str, ...] = ()
    warning: str | None = None


def on_every_rank(sum_over_ranks: Callable[[list[float]], list[float]], world: int) -> Agree:
    """The `agree` of `check` under torch.distributed: a flag holds where it holds on all `world` ranks."""
    return lambda flags: [total >= world for total in sum_over_ranks([float(f) for f in flags])]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Value:
    """One forward's loss as the weightings read it: the loss less its per-batch terms (`value`), or a
    `loss_fn`'s parts as (value, count or None) by name."""

    value: float
    dtype: torch.dtype  # the loss's: a float64 model's Hugging Face loss is computed in float32
    parts: tuple[tuple[str, float, float | None], ...] = ()
    scalar: bool = True  # a plain scalar (not (loss_sum, count) or a mapping of parts)
    terms: tuple[str, ...] = ()  # the per-batch terms the model's loss holds (a MoE's aux_loss)


def check(model: nn.Module, batch: Any, loss_fn: LossFn | None, *, chunked: bool,
          prepare: Callable[[Any], Any] | None = None, agree: Agree | None = None, most: int = SLICE,
          together: Together | None = None) -> CheckedLoss:
    """Check the chunked loss (when `chunked` allows it and the model takes it) and the micro-batch weighting
    of `loss_fn` (None: the model's own loss) on the first samples of `batch`.

    `prepare` turns a slice of the batch into what the model takes (default: on the model's device, `Shared`
    tensors unwrapped); `agree` makes every rank decide alike (`on_every_rank`), each rank running the same
    forwards; `most` caps the samples a forward takes; `together` wraps the forwards so that an error on one rank
    fails them on every rank (`parallel.leaving_together`: a sharded model's forwards run collectives). An error
    in a forward leaves the loss unchecked: the model's own, weighted as before, and the note says so (an error
    of autotune's own, such as no loss to train on, is left to the search or the step to raise, in its turn).
    """
    prepare = prepare if prepare is not None else _on_model_device(model)
    agree = agree if agree is not None else (lambda flags: flags)
    together = together if together is not None else contextlib.nullcontext
    whole_batch = batches.pick(batch, _samples(model, batch, min(most, SLICE)))
    m = batches.batch_size(whole_batch)
    labels = int_labels(whole_batch)
    countings, primary = _countings(model, labels)
    split = _split(countings, labels, m)
    try_chunked = chunked and loss_fn is None and chunked_loss.why_not(model) is None
    separable = loss_fn is not None or not hidden_terms(model)
    # flags: the chunked loss; then each weighting: samples, returned, tokens by each counting, then a sum
    flags = [False] * (4 + len(countings))
    whole: _Value | None = None
    failure = ""
    try:
        with evaluating(model), together():
            whole = _evaluate(model, prepare(whole_batch), loss_fn)
            if try_chunked:
                out = model_loss(model, prepare(whole_batch), chunked=True)
                chunked_value = float(out.loss.double()) - float(out.per_batch)
                flags[0] = _close(chunked_value, whole.value, _tolerance(model, whole))
            if split is not None and separable:
                a = _evaluate(model, prepare(batches.take(whole_batch, 0, split)), loss_fn)
                b = _evaluate(model, prepare(batches.take(whole_batch, split, m)), loss_fn)
                flags[1:] = _reproduces(whole, a, b, split, m, labels, countings, _tolerance(model, whole, a, b))
    except AutotuneError:  # autotune's own (no loss to train on): the search or the step raises it in its turn
        failure = "autotune"
    except Exception as exc:  # noqa: BLE001 - the model's error in eval mode: nothing checked, nothing substituted
        _raise_if_out_of_memory(exc)
        failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    flags = agree(flags)
    found = _decide(model, whole_batch, loss_fn, whole, flags, (countings, primary), split, m, failure, try_chunked,
                    separable, prepare, agree, together)
    whole_batch_only = [note for note in (_per_batch_terms(whole), _batch_statistics(model)) if note]
    return dataclasses.replace(found, notes=(*found.notes, *whole_batch_only)) if whole_batch_only else found


def check_and_record(model: nn.Module, batch: Any, loss_fn: LossFn | None, *, chunked: bool,
                     prepare: Callable[[Any], Any] | None = None, agree: Agree | None = None,
                     most: int = SLICE, together: Together | None = None) -> CheckedLoss:
    """`check`, and its choice recorded for `model` and `loss_fn`: what the search and `plan.apply` follow."""
    found = check(model, batch, loss_fn, chunked=chunked, prepare=prepare, agree=agree, most=most, together=together)
    record_choice(model, loss_fn, found.choice)
    return found


def _decide(model: nn.Module, batch: Any, loss_fn: LossFn | None, whole: _Value | None, flags: list[bool],
            tried: tuple[list[tuple[int, bool]], int], split: int | None, m: int, failure: str, try_chunked: bool,
            separable: bool, prepare: Callable[[Any], Any], agree: Agree, together: Together) -> CheckedLoss:
    """The choice from the agreed flags, `num_items_in_batch` checked where it is part of it, and the notes."""
    countings, primary = tried
    default = LossChoice.default(model)
    if failure or whole is None:
        kept = ("loss_fn's loss, weighted as it returns" if loss_fn is not None else
                "the model's own loss, unchunked, weighted as it says")
        note = f"the loss was not checked on the example batch ({failure}): {kept}"
        return CheckedLoss(choice=dataclasses.replace(default, chunked=False),
                           notes=(note,) if failure != "autotune" else ())
    notes: list[str] = []
    chunked = flags[0]
    if try_chunked and not chunked:
        notes.append("chunked_loss not used: on the example batch its loss differs from the model's own")
    if split is None or not separable:  # one sample, or a loss with a term no weighting can take apart
        return CheckedLoss(choice=dataclasses.replace(default, chunked=chunked), notes=tuple(notes))
    order = _order(loss_fn, whole, countings, primary)
    passing = [k for k in order if flags[k]]
    if not passing:
        what = "the model's own loss" if loss_fn is None else "loss_fn's loss"
        warning = (f"no micro-batch weighting reproduces {what} on the example batch (neither by label tokens nor "
                   f"by samples): over several micro-batches the gradients will differ from one full-batch step; "
                   f"{FIX}")
        return CheckedLoss(choice=dataclasses.replace(default, chunked=chunked), notes=(*notes, warning),
                           warning=warning)
    choice = _choice(passing[0], countings, chunked)
    if choice.by == "tokens" and loss_fn is None and takes_num_items(model) and not routes_with_loss(model):
        divided = [False]
        try:
            with evaluating(model), together():
                divided = [_divided(model, batch, choice, split, m, whole, prepare)]
        except AutotuneError:
            raise
        except Exception as exc:  # noqa: BLE001 - the model cannot take num_items_in_batch here: weighted as a mean
            _raise_if_out_of_memory(exc)
        if not agree(divided)[0]:
            choice = dataclasses.replace(choice, num_items=False)
            notes.append(f"num_items_in_batch not passed to {type(chunked_loss.unwrapped(model)).__name__}: on the "
                         "example batch its loss is not the sum over that total")
    if passing[0] != order[0]:
        notes.append(f"micro-batches weighted {choice.describe()}: the only weighting that reproduces the whole "
                     "batch's loss on the example")
    return CheckedLoss(choice=choice, notes=tuple(notes))


@contextlib.contextmanager
def out_of_memory_raised() -> Iterator[None]:
    """Inside, a forward of the check that runs out of memory raises, where it would leave the loss unchecked:
    a check visiting the GPU (`check_device.py`) runs again on the CPU instead."""
    _OOM_RAISED.append(True)
    try:
        yield
    finally:
        _OOM_RAISED.pop()


_OOM_RAISED: list[bool] = []  # one entry per open `out_of_memory_raised`


def _raise_if_out_of_memory(exc: Exception) -> None:
    if _OOM_RAISED and is_oom(exc):
        raise exc


def _per_batch_terms(whole: _Value | None) -> str | None:
    """What to say of a term the model's loss computes over the batch as a whole (a MoE's router loss)."""
    if whole is None or not whole.terms:
        return None
    return (f"the model's loss holds {', '.join(whole.terms)} (a router loss over the batch's routing): over "
            "several micro-batches it is the share-weighted mean of the micro-batches' values, not the whole "
            "batch's")


def _batch_statistics(model: nn.Module) -> str | None:
    """What to say of normalization layers that train on batch statistics (BatchNorm in train mode): they
    normalize over each micro-batch's samples, so no weighting gives the whole batch's loss."""
    names = sorted({type(m).__name__ for m in model.modules()
                    if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training})
    if not names:
        return None
    return (f"{', '.join(names)} normalizes over each micro-batch's samples in training (batch statistics), so "
            "over several micro-batches the loss and gradients are the accumulated micro-batches', not one "
            "whole-batch step's")


def _choice(flag: int, countings: list[tuple[int, bool]], chunked: bool) -> LossChoice:
    if flag == 3 + len(countings):
        return LossChoice(by="sum", num_items=False, chunked=chunked)
    if flag == 1:
        return LossChoice(by="samples", chunked=chunked)
    if flag == 2:
        return LossChoice(by="returned", chunked=chunked)
    ignore_index, shifted = countings[flag - 3]
    return LossChoice(by="tokens", ignore_index=ignore_index, shifted=shifted, chunked=chunked)


def _order(loss_fn: LossFn | None, whole: _Value, countings: list[tuple[int, bool]], primary: int) -> list[int]:
    """The flags' indices in the order the weightings are tried: as the loss says first; a guessed way of
    counting (another shift, a pad id) only after the samples, which it may equal on the example; a sum over
    the batch (CTC's "sum", the default of Wav2Vec2's config) last, for the model's own loss only."""
    counted = list(range(3, 3 + len(countings)))
    if loss_fn is None:  # the model's own: a token mean on labels (Hugging Face's), else a mean over samples
        return [*counted[:primary], 1, *counted[primary:], 3 + len(countings)]
    if not whole.scalar:  # (loss_sum, count) or named parts: what it returns, nothing else
        return [2]
    return [1, *counted]  # a scalar loss_fn: a mean over samples, unless it is found to be a token mean


def _countings(model: nn.Module, labels: torch.Tensor | None) -> tuple[list[tuple[int, bool]], int]:
    """(ignore index, shifted) of each way of counting the labels to try, and how many of them come first: the
    model's own ignore index (Segformer's `semantic_loss_ignore_index`, a config's `ignore_index`) and Hugging
    Face's -100 with the model's shift (the causal one for a causal LM's (B, T) labels) first; then the pad id
    and 0, and the other shift."""
    if labels is None:
        return [], 0
    inner = chunked_loss.unwrapped(model)
    configs = [getattr(inner, "config", None)]
    configs.append(getattr(configs[0], "text_config", None))
    declared = [getattr(c, name, None) for c in configs for name in ("semantic_loss_ignore_index", "ignore_index")]
    declared.append(getattr(inner, "ignore_index", None))
    pads = [getattr(c, "pad_token_id", None) for c in configs]
    ignores: list[int] = []
    for value in [*declared, IGNORE_INDEX, *pads, 0]:
        if isinstance(value, int) and not isinstance(value, bool) and value not in ignores:
            ignores.append(value)
    first = ignores.index(IGNORE_INDEX) + 1  # the declared ones and -100
    causal = is_causal_lm(model) and labels.dim() == 2
    shifts = [causal, not causal] if labels.dim() == 2 else [False]
    primary = [(ignore, causal) for ignore in ignores[:first]]
    rest = [(ignore, shifted) for ignore in ignores for shifted in shifts if (ignore, shifted) not in primary]
    return primary + rest, len(primary)


def _samples(model: nn.Module, batch: Any, most: int) -> list[int]:
    """The samples the check runs on: `most` whose labels hold something that counts (a sample whose labels are
    all ignored has a loss of nothing to compare), or the first `most` where fewer have. Among those, the first
    and the one whose count differs most from it come in: samples of equal counts cannot tell a token mean
    from a mean over samples."""
    n = batches.batch_size(batch)
    labels = int_labels(batch)
    if labels is not None:
        counts = dict((i, c) for i, c in enumerate(LossChoice.default(model).counts(labels).tolist()) if c > 0)
        if len(counts) >= min(n, most, 2):
            return _differing(counts, most)
    return list(range(min(n, most)))


def _differing(counts: dict[int, float], most: int) -> list[int]:
    """`most` of the samples (index -> count), in order: the first, the one whose count differs most from the
    first's, then the others in order."""
    order = list(counts)
    if len(order) <= most or most < 2:
        return order[:most]
    first = order[0]
    apart = max(order[1:], key=lambda i: abs(counts[i] - counts[first]))
    rest = [i for i in order[1:] if i != apart][:most - 2]
    return sorted([first, apart, *rest])


def _split(countings: list[tuple[int, bool]], labels: torch.Tensor | None, m: int) -> int | None:
    """Where to cut the slice in two: where the token shares differ most from the sample share (so that a
    wrong weighting shows), uneven on a tie. None for a single sample."""
    if m < 2:
        return None
    counts = [LossChoice(by="tokens", ignore_index=i, shifted=s).counts(labels) for i, s in countings] \
        if labels is not None else []

    def spread(k: int) -> tuple[float, bool]:
        shares = [k / m] + [float(c[:k].sum() / c.sum()) for c in counts if c.sum() > 0]
        return max(shares) - min(shares), 2 * k != m

    return max(range(1, m), key=spread)


def _evaluate(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> _Value:
    if loss_fn is None:
        out = model_loss(model, batch)
        return _Value(value=float(out.loss.double()) - float(out.per_batch), dtype=out.loss.dtype, terms=out.terms)
    value = loss_fn(model, batch)
    split = loss_parts(value)
    parts = tuple((p.name, float(torch.as_tensor(p.loss).double()),
                   None if p.count is None else float(torch.as_tensor(p.count).double())) for p in split)
    total = sum(v if c is None else _ratio(v, c) for _, v, c in parts)
    dtype = max((p.loss.dtype for p in split), key=lambda d: torch.finfo(d).eps if d.is_floating_point else 0.0)
    return _Value(value=total, dtype=dtype, parts=parts, scalar=isinstance(value, torch.Tensor))


def _reproduces(whole: _Value, a: _Value, b: _Value, k: int, m: int, labels: torch.Tensor | None,
                countings: list[tuple[int, bool]], tol: float) -> list[bool]:
    """Whether each weighting gives the whole's loss from the parts': samples, returned, each counting, then
    the parts added (a sum over the batch)."""
    samples = _close((k * a.value + (m - k) * b.value) / m, whole.value, tol)
    returned = not whole.scalar and _close(_returned(a, b, k, m), whole.value, tol)
    tokens = []
    for ignore, shifted in countings:
        assert labels is not None  # countings are only made for labels
        counts = LossChoice(by="tokens", ignore_index=ignore, shifted=shifted).counts(labels)
        ca, cb = float(counts[:k].sum()), float(counts[k:].sum())
        parts = [c * v for c, v in ((ca, a.value), (cb, b.value)) if c > 0]  # a part of no tokens adds nothing
        tokens.append(ca + cb > 0 and _close(sum(parts) / (ca + cb), whole.value, tol))
    summed = labels is not None and _close(a.value + b.value, whole.value, tol)
    return [samples, returned, *tokens, summed]


def _returned(a: _Value, b: _Value, k: int, m: int) -> float:
    """The whole's loss from the parts' returns: (loss_sum, count) parts summed and divided by the summed
    counts, means over samples weighted by their samples."""
    total = 0.0
    for (_, va, ca), (_, vb, cb) in zip(a.parts, b.parts):
        if ca is None or cb is None:
            total += (k * va + (m - k) * vb) / m
        else:
            total += _ratio(va + vb, ca + cb)
    return total


def _ratio(a: float, b: float) -> float:
    """a / b, NaN for 0 / 0 (torch's reading of a mean over nothing) and inf for a / 0."""
    return a / b if b else math.nan if not a else math.copysign(math.inf, a)


def _divided(model: nn.Module, batch: Any, choice: LossChoice, k: int, m: int, whole: _Value,
             prepare: Callable[[Any], Any]) -> bool:
    """Whether the model, passed the slice's token total as `num_items_in_batch`, returns each part's sum over
    it: the parts' losses then add up to the whole's."""
    labels = int_labels(batch)
    assert labels is not None  # a token weighting is only chosen on labels
    total = float(choice.counts(labels).sum())
    parts = [model_loss(model, prepare(batches.take(batch, start, stop)), total)
             for start, stop in ((0, k), (k, m))]
    got = sum(float(p.loss.double()) for p in parts)
    return _close(got, whole.value, _tolerance(model, whole))


def _close(got: float, want: float, tol: float) -> bool:
    return math.isfinite(got) and math.isfinite(want) and abs(got - want) <= tol * max(abs(got), abs(want), 1e-30)


def _tolerance(model: nn.Module, *values: _Value) -> float:
    """The relative tolerance for the model's dtype: the least precise of its floating parameters' and the
    losses'."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()} or {torch.float32}
    dtypes |= {v.dtype for v in values if v.dtype.is_floating_point}
    tol = max(TOLERANCE.get(d, TOLERANCE[torch.float16]) for d in dtypes)
    on_gpu = any(p.device.type == "cuda" for p in model.parameters())
    if torch.float32 in dtypes and on_gpu and torch.backends.cuda.matmul.allow_tf32:
        tol = max(tol, TF32_TOLERANCE)
    return tol


def _on_model_device(model: nn.Module) -> Callable[[Any], Any]:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return lambda b: batches.unwrap(batches.to_device(b, device))
