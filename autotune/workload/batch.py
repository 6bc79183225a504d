"""Operations on a user's batch: a Tensor, a tuple/list or a mapping of Tensors, batch dimension first.

Everything here treats the batch as a tree whose tensor leaves share dimension 0; non-tensor leaves
(a string, a flag) pass through unchanged. A mapping is any `collections.abc.Mapping`, not only a `dict`:
a tokenizer returns a `BatchEncoding` (a `UserDict`), and that is the batch people pass first.

A tensor that is not per-sample (an attention bias or a lookup table every sample uses) is marked
`Shared(tensor)`: it is never sliced, repeated or counted as a batch, whatever its first dimension, moves
to the device with the batch, and reaches the model (and a `loss_fn`) as the plain tensor. Without the
mark, a tensor whose dimension 0 happens to equal the batch size would be split across micro-batches like
the samples, and one whose dimension 0 differs is refused.

Inside the batch, a list or tuple that holds no tensor (strings, numbers, lists of them), or one record (a
mapping) per sample such as a detection model's targets, is a list of per-sample values: as long as the
batch, it is split, picked and repeated like a tensor; of another length it goes whole to every micro-batch,
except a list of records, which is refused (a record per sample must be one per sample). Its tensors (a
record's) move to the device with the batch but are never counted as a batch dimension. A list or tuple of
tensors is part of the batch's structure, each tensor split along dimension 0 (the batch itself, `(x, y)`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidSetting

Batch = Any  # Tensor | tuple | list | Mapping of those


@dataclass(frozen=True, slots=True)
class Shared:
    """A tensor of the batch that every sample shares: passed whole to every micro-batch, never sliced.

    >>> batch = {"input_ids": ids, "labels": ids, "bias": autotune.Shared(alibi)}  # alibi: (heads, T, T)
    """

    tensor: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.tensor, torch.Tensor):
            raise InvalidSetting(f"autotune.Shared marks a tensor; got {type(self.tensor).__name__}")


def _leaves(batch: Batch, top: bool = True) -> list[torch.Tensor]:
    if isinstance(batch, Shared) or (not top and _per_sample(batch)):
        return []  # not a batch: no dimension 0 to agree on
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _leaves(v, False)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _leaves(v, False)]
    return []


def _per_sample(value: Any) -> bool:
    """Whether `value`, inside a batch, is a list of per-sample values (see the module's docstring)."""
    if not isinstance(value, (list, tuple)) or not value or hasattr(value, "_fields"):  # a namedtuple: structure
        return False
    return all(isinstance(v, Mapping) for v in value) or not _holds_tensor(value)


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, Shared)):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _map(batch: Batch, fn: Any, shared: Any = None, samples: Any = None, top: bool = True) -> Batch:
    """`batch` with `fn` applied to every per-sample tensor and `shared` to every `Shared` one (None: kept),
    and `samples` to every list of per-sample values (None: `fn` applied to the tensors inside it)."""
    if isinstance(batch, Shared):
        return batch if shared is None else shared(batch)
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if not top and _per_sample(batch):
        return samples(batch) if samples is not None else type(batch)(_map(v, fn, shared) for v in batch)
    if isinstance(batch, Mapping):
        return _rebuild(batch, {k: _map(v, fn, shared, samples, False) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map(v, fn, shared, samples, False) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map(v, fn, shared, samples, False) for v in batch)
    return batch


def _sample_lists(batch: Batch, path: str = "batch", top: bool = True) -> list[tuple[str, list | tuple]]:
    """(path, list) of every list of per-sample values in the batch."""
    if not top and _per_sample(batch):
        return [(path, batch)]
    if isinstance(batch, Mapping):
        return [x for k, v in batch.items() for x in _sample_lists(v, f"{path}[{k!r}]", False)]
    if isinstance(batch, (list, tuple)):
        return [x for i, v in enumerate(batch) for x in _sample_lists(v, f"{path}[{i}]", False)]
    return []


def _of_samples(batch: Batch, select: Any) -> Any:
    """A `samples` for `_map`: `select(list)` for a list as long as the batch, the list itself otherwise."""
    size: list[int] = []

    def apply(values: list | tuple) -> Any:
        if not size:
            size.append(batch_size(batch))
        return type(values)(select(values)) if len(values) == size[0] else values

    return apply


def _rebuild(batch: Mapping, items: dict) -> Mapping:
    """A mapping of `batch`'s type holding `items`: `BatchEncoding`, `UserDict`, `OrderedDict` and dict
    subclasses take a dict; one whose constructor does not becomes a plain dict (the model gets
    `**batch` either way)."""
    if type(batch) is dict:
        return items
    if isinstance(batch, defaultdict):
        return type(batch)(batch.default_factory, items)
    try:
        kind: Any = type(batch)  # a Mapping subclass whose constructor may or may not take a dict
        rebuilt = kind(items)
    except Exception:  # noqa: BLE001 - any constructor that does not take a dict: the plain one does
        return items
    return rebuilt if isinstance(rebuilt, Mapping) and set(rebuilt.keys()) == set(items) else items


def batch_size(batch: Batch, setting: str = "batch") -> int:
    """The size of dimension 0, checked to agree across the batch's tensors."""
    leaves = [t for t in _leaves(batch) if t.dim() > 0]
    if not leaves:
        raise InvalidSetting(f"{setting} holds no tensor with a batch dimension; pass a Tensor, a tuple/list or "
                             "a mapping (dict, BatchEncoding) of Tensors whose dimension 0 is the batch")
    sizes = {t.shape[0] for t in leaves}
    if len(sizes) > 1:
        raise InvalidSetting(f"{setting}'s tensors disagree on the batch dimension (dim 0 sizes {sorted(sizes)}); "
                             "every tensor must have the batch first, or, if every sample uses it whole (a mask, "
                             "a bias, a table), be marked autotune.Shared(tensor)")
    size = sizes.pop()
    if size == 0:
        raise InvalidSetting(f"{setting} is empty (batch dimension 0); pass at least one example")
    for path, values in _sample_lists(batch, setting):
        if len(values) != size and all(isinstance(v, Mapping) for v in values):
            raise InvalidSetting(f"{path} is a list of {len(values)} records (mappings), but {setting} holds {size} "
                                 "samples; give one record per sample, in the samples' order")
    return size


def take(batch: Batch, start: int, stop: int) -> Batch:
    """Samples [start, stop) of every tensor (views, no copy) and of every list of per-sample values."""
    return _map(batch, lambda t: t[start:stop] if t.dim() > 0 else t,
                samples=_of_samples(batch, lambda values: values[start:stop]))


def pick(batch: Batch, indices: list[int]) -> Batch:
    """The samples at `indices`, in that order (copies)."""
    rows = torch.tensor(indices, dtype=torch.long)
    return _map(batch, lambda t: t[rows.to(t.device)] if t.dim() > 0 else t,
                samples=_of_samples(batch, lambda values: [values[i] for i in indices]))


def padded_first(batch: Batch) -> Batch:
    """`batch` with its fullest padded sample moved first, where a mask marks some samples padded and the first
    one not; else `batch` itself. The trials run their micro-batch on the first samples, and a padded one builds
    what an unpadded one skips (a model drops the attention mask where every position attends), so a trial at a
    micro-batch of 1 on an unpadded sample would measure a peak that training's padded samples pass."""
    masks = _padding_masks(batch)
    if not masks:
        return batch
    whole = torch.stack([(m != 0).all(dim=1) for m in masks]).all(dim=0)  # per sample: no position masked
    if not bool(whole[0]) or bool(whole.all()):
        return batch
    kept = torch.stack([(m != 0).sum(dim=1) for m in masks]).sum(dim=0).masked_fill(whole, -1)
    first = int(kept.argmax())
    return pick(batch, [first, *(i for i in range(batch_size(batch)) if i != first)])


def _padding_masks(batch: Batch) -> list[torch.Tensor]:
    """A mapping batch's padding masks: its entries named `...mask` that are integer or boolean (samples,
    positions) tensors of zeros and ones."""
    if not isinstance(batch, Mapping):
        return []
    n = batch_size(batch)
    return [v for k, v in batch.items()
            if isinstance(k, str) and k.endswith("mask") and isinstance(v, torch.Tensor) and v.dim() == 2
            and v.shape[0] == n and not v.is_floating_point() and not v.is_complex()
            and bool(((v == 0) | (v == 1)).all())]


def resize(batch: Batch, n: int) -> Batch:
    """A batch of exactly `n` samples: the first `n`, or the example repeated cyclically to reach `n`."""
    have = batch_size(batch)
    if n <= have:
        return take(batch, 0, n)
    return _map(batch, lambda t: t[torch.arange(n, device=t.device) % have] if t.dim() > 0 else t,
                samples=_of_samples(batch, lambda values: [values[i % have] for i in range(n)]))


def to_device(batch: Batch, device: torch.device) -> Batch:
    return _map(batch, lambda t: t.to(device, non_blocking=True),
                lambda s: Shared(s.tensor.to(device, non_blocking=True)))


def shared_to_device(batch: Batch, device: torch.device) -> Batch:
    """`batch` with its `Shared` tensors on `device` and the per-sample ones left where they are (the training
    step moves those a micro-batch at a time)."""
    return _map(batch, lambda t: t, lambda s: Shared(s.tensor.to(device, non_blocking=True)))


def unwrap(batch: Batch) -> Batch:
    """The batch as the model gets it: every `Shared` tensor as the plain tensor."""
    return _map(batch, lambda t: t, lambda s: s.tensor)


def detached(batch: Batch) -> Batch:
    """The batch with every tensor detached from the caller's: new leaves on the same storage, with the
    same `requires_grad`, so backward fills their `.grad`, not the caller's."""
    def detach(t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else t.detach()

    return _map(batch, detach, lambda s: Shared(detach(s.tensor)))


def signature(batch: Batch) -> list[tuple[str, tuple[int, ...], str]]:
    """(path, shape without the batch dimension, dtype) of every tensor: what the cache keys on."""
    out: list[tuple[str, tuple[int, ...], str]] = []

    def walk(obj: Any, path: str, top: bool = False) -> None:
        if not top and _per_sample(obj):  # one entry: its values are data, not shapes
            out.append((f"{path}(per-sample {type(obj).__name__})", (), type(obj).__name__))
        elif isinstance(obj, Shared):  # the whole shape: it is not per-sample
            out.append((f"{path}(shared)", tuple(obj.tensor.shape), str(obj.tensor.dtype).replace("torch.", "")))
        elif isinstance(obj, torch.Tensor):
            out.append((path, tuple(obj.shape[1:]), str(obj.dtype).replace("torch.", "")))
        elif isinstance(obj, Mapping):
            for k in sorted(obj, key=str):
                walk(obj[k], f"{path}.{k}" if path else str(k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]")

    walk(batch, "", top=True)
    return out


def tokens_per_sample(batch: Batch) -> int | None:
    """Sequence length for token batches (an integer tensor of shape (B, T)), else None."""
    for t in _leaves(batch):
        if t.dim() == 2 and not t.is_floating_point() and t.dtype != torch.bool:
            return int(t.shape[1])
    return None


def lengthen(batch: Batch, length: int) -> Batch:
    """`batch` with its sequence dimension (dim 1 of every tensor as long as its token tensor's) tiled out to
    `length`: the example a trial runs at the longest sequence training will see. Token ids, labels and masks
    repeat their own values, so the model sees real ids and the loss counts every position."""
    t = tokens_per_sample(batch)
    if t is None or length <= t:
        return batch

    def longer(x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[1] != t:
            return x
        reps = [1] * x.dim()
        reps[1] = -(-length // t)
        return x.repeat(*reps)[:, :length].contiguous()

    return _map(batch, longer, samples=lambda values: values)


def tensors(batch: Batch) -> list[torch.Tensor]:
    """Every tensor in the batch, in a fixed order."""
    return _leaves(batch)
