"""The checkpointing rung: recompute the model's repeated blocks in backward instead of storing them.

Blocks are found automatically (`blocks.py`): every group of same-class children holding activations (a
transformer's layers, a T5 encoder's and decoder's blocks, a ResNet's bottlenecks in every stage, blocks
held as attributes). Any number of them, 0..N over all groups, may be recomputed (`install(blocks,
count)`), those holding the most activation memory first: the search picks the count from the bytes per
sample measured with none and with all of them recomputed; "selective" is any count between, "full" all.
A module called at several depths (ALBERT's shared layer) has one block per call: k of its N calls are
recomputed, the others run as they are. Checkpointing is non-reentrant (`use_reentrant=False`): it supports
keyword arguments and restores the dropout RNG on recompute. Under activation offload the block's input,
passed first or by keyword (`hidden_states`), is kept on the host.

Guards: recomputing a block never changes its state a second time, and the recompute computes with the
state the forward saw, so gradients and buffers are those of no checkpointing. Every buffer in the block's
modules (a parametrization's too: spectral norm's `_u`/`_v`, the hook form's `weight_u`/`weight_v`) that its
forward writes is put back to its pre-forward value for the recompute and to its current value after it
(`_Writes`): written in place (seen by its version counter), reassigned (seen by identity), through `.data`
(seen by value on the block's first forward) or by a norm layer's kernel (BatchNorm, InstanceNorm with
`track_running_stats`, known by type: their running statistics are not inputs of a training forward, so only
the current values are kept). Only the buffers a forward wrote are copied, learned on the block's first
forward. A block whose forward writes what cannot be put back (a parameter in place; a buffer outside the
block, seen by `blocks.profile_blocks`) is not recomputed: the profile leaves it out of the plan's blocks
and says why, and a block found so in training runs plain from then on, with a warning. The block's own
forward hooks run once, because the block's `forward` is what is wrapped, not its `__call__`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..devices.placement import Placement
from ..training.buffers import tracks_statistics
from .blocks import BlockGroup, find_blocks, refusal, refuse
from .offload import to_device, to_host

__all__ = ["BlockGroup", "find_blocks", "install"]

log = logging.getLogger(__name__)


def install(blocks: BlockGroup, count: int, *, offload_activations: bool, placement: Placement,
            inner: Callable[[nn.Module], Callable[..., Any]] | None = None) -> Callable[[], None]:
    """Wrap the first `count` blocks' `forward` with non-reentrant checkpointing (a module called at several
    depths: on the calls among them); returns the undo function. `inner`
    gives what the checkpoint runs for a block instead of its own forward (`compile.forward`: the block
    compiled inside its checkpoint). A block refused for recompute (`blocks.refusal`) runs as it is (through
    `inner`, when given)."""
    chosen = blocks.calls(count)
    for block, calls in chosen.items():
        # the bound method (restored by deleting the instance attribute), or what `inner` makes of the block
        original = inner(block) if inner is not None else block.forward
        if refusal(block):
            if inner is not None:
                block.forward = original
            continue
        wrapped = _checkpointed(block, original, offload_activations, placement)
        block.forward = wrapped if calls is None else _on_calls(original, wrapped, *calls)

    def remove() -> None:
        for block in chosen:
            block.__dict__.pop("forward", None)

    return remove


def _on_calls(original: Callable[..., Any], wrapped: Callable[..., Any], picked: frozenset[int],
              n: int) -> Callable[..., Any]:
    """A forward that runs `wrapped` (checkpointed) on the calls in `picked` of every `n` (a module called at
    `n` depths) and `original` on the others. Calls are counted modulo `n`, with or without grad: the calls of
    one module hold alike, so only how many of the `n` are recomputed sets what a forward holds."""
    count = [0]

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        call = count[0] % n
        count[0] += 1
        return (wrapped if call in picked else original)(*args, **kwargs)

    return forward


def _checkpointed(block: nn.Module, original: Callable[..., Any], offload: bool,
                  placement: Placement) -> Callable[..., Any]:
    writes = _Writes(block)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or refusal(block):
            return original(*args, **kwargs)
        args, kwargs = _without_kv_cache(args, kwargs)
        key = _input_key(args, kwargs) if offload else None
        if key is None and writes.idle:
            # Nothing to put back or park: a plain checkpoint of the block.
            return checkpoint(original, *args, use_reentrant=False, **kwargs)
        calls = [0]
        first_input = [] if key is None else [_argument(args, kwargs, key)]
        wants_grad = bool(first_input) and first_input[0].requires_grad
        record = writes.before()

        def run(*inner: Any, **inner_kwargs: Any) -> Any:
            calls[0] += 1
            if key is not None:
                # Forward uses the device tensor it was given (gradients flow to it directly); the
                # recompute brings the parked copy back. Only the saved values matter in a recompute.
                x = first_input.pop() if first_input else to_device(_argument(inner, inner_kwargs, key),
                                                                     placement.torch_device)
                inner, inner_kwargs = _with_argument(inner, inner_kwargs, key,
                                                     x.requires_grad_(wants_grad) if calls[0] > 1 else x)
            if calls[0] == 1:
                return original(*inner, **inner_kwargs)
            with writes.replayed(record):  # a recompute: the state the forward saw, then the state as it is
                return original(*inner, **inner_kwargs)

        if key is not None:
            # The block's input is the one tensor a checkpointed block keeps alive: keep it on the host.
            args, kwargs = _with_argument(args, kwargs, key, to_host(first_input[0]))
        out = checkpoint(run, *args, use_reentrant=False, **kwargs)
        why = writes.after(record)
        if why:
            refuse(block, why)
            log.warning("autotune: a recomputed block (%s) is not recomputed from now on: %s, which its "
                        "recompute in backward writes a second time (this forward's recompute still does). A plan "
                        "from autotune.fit leaves such a block out", type(block).__name__, why)
        return out

    return forward


HIDDEN = "hidden_states"  # what Hugging Face names a layer's input, when a model passes it by keyword


def _input_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | str | None:
    """Where the block's input (the activation it is called on, which activation offload parks) is among its
    arguments: its first positional argument when that is a tensor; for a block called by keyword (Mllama's
    `layer(hidden_states=h, ...)`), `hidden_states`, else the first keyword argument that is a floating-point
    tensor; None when it has no such argument."""
    if args:
        return 0 if isinstance(args[0], torch.Tensor) else None
    if isinstance(kwargs.get(HIDDEN), torch.Tensor):
        return HIDDEN
    return next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()), None)


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], key: int | str) -> Any:
    return args[key] if isinstance(key, int) else kwargs[key]


def _with_argument(args: tuple[Any, ...], kwargs: dict[str, Any], key: int | str,
                   value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments with the one at `key` (a position or a keyword) replaced by `value`."""
    if isinstance(key, int):
        return (*args[:key], value, *args[key + 1:]), kwargs
    return args, {**kwargs, key: value}


def _without_kv_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The block's arguments with any Hugging Face KV cache (`transformers` `Cache`) replaced by None.

    A decoder layer appends its keys and values to the cache in forward; the recompute in backward would
    append them again (keys twice as long as the queries: a shape error, or silently wrong attention).
    Training reads nothing back from it, so a checkpointed block gets none, as Hugging Face's own
    checkpointing does. GPT-2 passes the cache positionally, hence both args and kwargs.
    """
    return (tuple(None if _is_kv_cache(a) else a for a in args),
            {k: None if _is_kv_cache(v) else v for k, v in kwargs.items()})


def _is_kv_cache(value: Any) -> bool:
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


@dataclass(kw_only=True, slots=True)
class _Record:
    """One forward of a block, for its recompute: the block's buffers as the forward found them (`tensors`,
    `versions`, by slot), copies of the values the recompute needs (`saved`), the slots the forward wrote."""

    tensors: list[torch.Tensor | None]
    versions: list[int]
    saved: dict[int, torch.Tensor]
    params: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)  # on a block's first forward
    written: list[int] = field(default_factory=list)
    reassigned: set[int] = field(default_factory=set)

    def before(self, slot: int) -> torch.Tensor | None:
        """The slot's value before the forward; None where it was not kept."""
        if slot in self.saved:
            return self.saved[slot]
        old = self.tensors[slot]
        intact = slot in self.reassigned and old is not None and old._version == self.versions[slot]
        return old if intact else None  # a reassigned buffer whose old tensor was left as it was


class _Writes:
    """The buffers a block's forward writes, and how a recompute of that forward is given what it saw.

    A slot is a (module, buffer name) of a module in the block. On the block's first forward every buffer
    is copied and the written ones are learned (version counter, identity, value); later forwards copy only
    those. A norm layer's running statistics are written in every training forward and never read by it:
    they are kept only at the recompute, to be put back after it.
    """

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.slots = [(m, name) for m in block.modules() for name, b in m._buffers.items() if b is not None]
        self.norms = {i for i, (m, _) in enumerate(self.slots) if tracks_statistics(m)}
        self.learned: set[int] | None = None  # slots whose pre-forward values a recompute needs; None: not yet seen
        self.late: set[int] = set()  # slots first written after the first forward (warned about once)

    @property
    def idle(self) -> bool:
        """A block with no buffer, after its first forward: nothing to watch."""
        return not self.slots and self.learned is not None

    def before(self) -> _Record:
        """Before the forward: what the recompute may need."""
        tensors = [m._buffers.get(name) for m, name in self.slots]
        keep = range(len(tensors)) if self.learned is None else self.learned
        with torch.no_grad():
            saved = {i: t.clone() for i in keep if i not in self.norms and (t := tensors[i]) is not None}
        params: list[tuple[str, torch.Tensor, int]] = (
            [(n, p, p._version) for n, p in self.block.named_parameters()] if self.learned is None else [])
        return _Record(tensors=tensors, versions=[-1 if t is None else t._version for t in tensors], saved=saved,
                       params=params)

    def after(self, record: _Record) -> str | None:
        """After the forward: the slots it wrote, kept for the recompute; why the block cannot be recomputed
        (a parameter it writes), or None."""
        first, seen = self.learned is None, set()
        for i, ((module, name), old) in enumerate(zip(self.slots, record.tensors)):
            now = module._buffers.get(name)
            if now is None or id(now) in seen:  # a buffer shared by two modules is one slot, its first
                continue
            seen.add(id(now))
            moved = now is not old or now._version != record.versions[i]
            if not moved and i in record.saved:
                # A write through `.data` moves no version counter: seen by value on the first forward, and a
                # slot learned is replayed on every forward after it.
                moved = not first or not (now.shape == record.saved[i].shape and torch.equal(now, record.saved[i]))
            if moved or (i in self.norms and module.training):
                record.written.append(i)
                if now is not old:
                    record.reassigned.add(i)
        wrote = {i for i in record.written if i not in self.norms}
        new = wrote - set(record.saved) - record.reassigned - self.late
        if new and not first:
            self.late |= new
            log.warning("autotune: a recomputed block (%s) wrote %s in a forward after its first, which did not; "
                        "this forward's recompute sees the value it wrote (kept for every later forward)",
                        type(self.block).__name__, ", ".join(self._name(i) for i in sorted(new)))
        self.learned = (self.learned or set()) | wrote
        record.saved = {i: v for i, v in record.saved.items() if i in wrote}
        record.tensors = [t if i in record.reassigned else None for i, t in enumerate(record.tensors)]
        moved_params = [n for n, p, v in record.params if p._version != v]
        record.params = []
        if moved_params:
            return f"its forward writes parameter {moved_params[0]} in place"
        return None

    @contextmanager
    def replayed(self, record: _Record) -> Iterator[None]:
        """Around a recompute: each written buffer as the forward found it, then as it is now (the forward
        and any later ones have written it since)."""
        back: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor | None]] = []
        try:
            with torch.no_grad():
                for i in record.written:
                    module, name = self.slots[i]
                    now, old = module._buffers.get(name), record.before(i)
                    if now is None:
                        continue
                    if i in record.reassigned and old is not None:
                        back.append((module, name, now, None))  # the recompute assigns another tensor
                        module._buffers[name] = old.clone()
                        continue
                    back.append((module, name, now, now.clone()))
                    if old is not None and old.shape == now.shape:
                        now.copy_(old)
            yield
        finally:
            with torch.no_grad():
                for module, name, now, value in reversed(back):
                    module._buffers[name] = now
                    if value is not None:
                        now.copy_(value)

    def _name(self, slot: int) -> str:
        module, name = self.slots[slot]
        path = next((p for p, m in self.block.named_modules() if m is module), "")
        return f"{path}.{name}" if path else name
