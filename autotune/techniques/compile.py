"""The compile knob: `torch.compile` on the model's repeated blocks (or the whole model), composed with
checkpointing the way it pays.

Where the model has repeated blocks, each block is compiled on its own and the rest of the model stays
eager. A recomputed block is compiled *inside* its checkpoint (`forward`, which `checkpointing.install`
wraps): the checkpoint drops what the compiled graph saved and runs the compiled forward again in
backward, so the recompute uses the same fused kernels and Inductor never sees a checkpoint. The other
order, a compiled checkpoint wrapper (torchtitan's), hands the recompute to Inductor's partitioner, which
can fail on large models ("Node ... was invalid, but is output") and gained nothing where it ran. Compiled
inside, the gradients are bitwise those of
the compiled block without recompute, dropout included (the checkpoint restores the RNG state that
Inductor's seeds are drawn from; tests/test_compile_regions.py). Identical blocks share one compiled graph
(their parameters are graph inputs), so compile time is one block's, not N blocks' (compiling a whole
36-block model can take most of a tune). A model without repeated blocks is compiled whole. `$AUTOTUNE_COMPILE_REGIONS`
= "whole" compiles the whole model when no block is recomputed (the most fusion, the longest compile).

Compile is a speed and a memory technique: fused kernels keep fewer intermediates (a GPT-2 can peak at
half of eager's memory at the same micro-batch). Its cost is compile time, paid at
the first step; torch's own on-disk caches (Inductor's FX graph cache) make a second tune of the same
model cheaper. The batch dimension of every compiled call's inputs is marked dynamic before the call,
so a change of micro-batch (the next trial, a recovery, an uneven last micro-batch) reuses the graph; for a
token batch the sequence dimension is too, from the first call, so training on padded batches of every length
compiles one graph per block instead of one per length (up to dynamo's recompile limit, then eager).

Training (`plan.apply`) compiles each call once more, static, at the first shapes it runs at the plan's
micro-batch (`static_at`): kernels specialized to one shape are faster than symbolic ones (benchmarks/RESULTS.md,
"The budget's cost"), and a training run at a fixed shape repeats that shape every step; the price is one more
compile at the first step. Any other shape (an uneven last micro-batch, a recovery's smaller
micro-batch, a new sequence length) runs the dynamic graph the trials compiled and measured, so no shape
compiles more than once. `$AUTOTUNE_COMPILE_STATIC=0` keeps training on the dynamic graphs.

On an FSDP2-sharded model each unit's `forward` is compiled and its `__call__`, where FSDP gathers the
unit's parameters before and reshards them after, stays eager: the graph sees whole parameters and no
collective.

Compiling this way (what `nn.Module.compile()` does) keeps the module object and its state dict as they
are, and is undone by dropping the compiled call; a model that cannot be compiled falls back to eager with
a note (the search records the failed trial and goes on without compile).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .. import settings, torch_private
from ..devices.placement import Placement
from ..errors import InvalidSetting
from ..workload.batch import tensors
from .checkpointing import BlockGroup
from .sharding import is_sharded, is_unit

# Each trial of a new configuration may add a guard set per compiled code object (shapes, checkpointed or
# not); the default of 8 would send a long search back to eager silently.
_CACHE_LIMIT = 64


def unavailable(placement: Placement) -> str | None:
    """Why compile cannot be searched here, or None when it can."""
    if placement.simulated:
        return "compile left out on the simulated CPU device (it measures nothing there but compile time)"
    triton = torch_private.has_triton()
    if triton is None:  # pragma: no cover - a torch without the check
        return "compile left out: this torch has no Triton check"
    if not triton:
        return "compile left out: Triton is not installed for this GPU (pip install triton)"
    return None


def install(model: nn.Module, blocks: BlockGroup | None, checkpointed: int) -> Callable[[], None]:
    """Compile `model`'s repeated blocks but the first `checkpointed` (those are compiled inside their
    checkpoint, by `checkpointing.install` through `forward`), or the whole model (see the module
    docstring); returns the undo function."""
    _raise_cache_limits()
    # read first: a bad setting fails on every model; FSDP2 shards compile per unit, never the whole
    whole = regions() == "whole" and checkpointed == 0 and not is_sharded(model)
    # No blocks (none found, or the model's library checkpoints its own): the whole model.
    per_block = blocks is not None and bool(blocks.blocks) and not whole
    # A module called at several depths with some calls recomputed runs compiled through its checkpoint's
    # wrapper (`inner`) on its other calls too: only modules with no call recomputed are compiled here.
    recomputed = set(blocks.calls(checkpointed)) if per_block and blocks is not None else set()
    targets = ([m for m in blocks.modules() if m not in recomputed] if per_block and blocks is not None
               else [model])
    for module in targets:
        if is_unit(module):  # FSDP2's gather and reshard hooks stay eager around the compiled forward,
            # compiled around, not into the graph, as torchtitan compiles each block inside its wrapping
            module.forward = forward(module)
        else:
            module._compiled_call_impl = _compiled(module)  # what nn.Module.compile() sets
    restore_cache = _no_kv_cache(model) if per_block else (lambda: None)
    length_hook = model.register_forward_pre_hook(_record_length, with_kwargs=True)

    def remove() -> None:
        for module in targets:
            module._compiled_call_impl = None  # what nn.Module.compile set; __call__ is eager again
            module.__dict__.pop("forward", None)  # a unit's compiled forward: its class's again
        length_hook.remove()
        restore_cache()

    return remove


# One compiled callable per module, reused by every trial and by training: a fresh torch.compile wrapper
# brings a fresh backend, whose guard would miss every graph compiled before and compile them again.
# `_WRAPPERS` holds the module's whole call (`_call_impl`), `_FORWARDS` a recomputed block's forward. Neither
# may hold its module: a weak key whose value refers to it is never freed, and every model `fit` compiled
# would stay on the GPU after the user dropped it (see `_weakly_bound`).
_WRAPPERS: weakref.WeakKeyDictionary[nn.Module, Callable[..., object]] = weakref.WeakKeyDictionary()
_FORWARDS: weakref.WeakKeyDictionary[nn.Module, Callable[..., object]] = weakref.WeakKeyDictionary()


def _compiled(module: nn.Module) -> Callable[..., object]:
    return _once(_WRAPPERS, module, lambda: module._call_impl)


def forward(block: nn.Module) -> Callable[..., object]:
    """`block.forward` as it is before the checkpoint wraps it, compiled: what a recomputed block's
    checkpoint runs, in forward and again in backward."""
    return _once(_FORWARDS, block, lambda: block.forward)


def _once(cache: weakref.WeakKeyDictionary[nn.Module, Callable[..., object]], module: nn.Module,
          target: Callable[[], Callable[..., object]]) -> Callable[..., object]:
    """`target()` compiled, once per module in `cache`, with the batch dimension of its inputs marked
    dynamic before each call (a block's inputs are the model's activations, marked here)."""
    if module not in cache:
        cache[module] = _weakly_bound(module, target())
    return cache[module]


def _weakly_bound(module: nn.Module, method: Callable[..., object]) -> Callable[..., object]:
    """`method` compiled and called with its batch dimension marked, holding `module` by a weak reference; in
    training at the plan's micro-batch, the static graph instead (`_StaticGraph`); under a dispatch mode (a loss
    check's forward, a FLOP count), eager: Dynamo, reaching the frame there, would mark its code skipped and every
    later call of the block would run eager too.

    A method of `module` is compiled as its class's function and handed the module at each call: Dynamo traces
    the same frame (the method's code with `self` the module) as for the bound method, so graphs and guards
    are unchanged. Anything else (a function set on the instance) is compiled as it is."""
    bound = inspect.ismethod(method) and getattr(method, "__self__", None) is module
    target = getattr(method, "__func__", method) if bound else method
    dynamic, static, owner = torch.compile(target), _StaticGraph(target), weakref.ref(module)

    def call(*args: object, **kwargs: object) -> object:
        full = (owner(), *args) if bound else args
        if not torch.compiler.is_compiling() and torch_private.dispatch_mode_blocks_compile():
            return target(*full, **kwargs)  # eager, as Dynamo would run it, without marking the code skipped
        if static.takes((args, kwargs)):
            return static(*full, **kwargs)
        mark_batch_dynamic((args, kwargs), _SEQUENCE.length)
        return dynamic(*full, **kwargs)

    return call


class _StaticGraph:
    """One compiled call's static graph: compiled (`dynamic=False`) at the first inputs it is asked to take
    under `static_at`, and taking only inputs of those very shapes and dtypes after, so it compiles once."""

    def __init__(self, target: Callable[..., object]) -> None:
        self.target = target
        self.compiled: Callable[..., object] | None = None
        self.signature: tuple[tuple[tuple[int, ...], torch.dtype], ...] | None = None

    def takes(self, inputs: object) -> bool:
        """Whether this call runs the static graph: in training (`static_at`), at the plan's micro-batch, with
        the inputs' shapes those of its first such call."""
        if not runs_static(_SEQUENCE.rows):
            return False
        signature = tuple((tuple(t.shape), t.dtype) for t in tensors(inputs))
        if self.signature is None:
            self.signature = signature
        return signature == self.signature

    def __call__(self, *args: object, **kwargs: object) -> object:
        if self.compiled is None:
            self.compiled = torch.compile(self.target, dynamic=False)
        return self.compiled(*args, **kwargs)


def runs_static(rows: int | None) -> bool:
    """Whether a model batch of `rows` samples runs the static graphs (`static_at`): its inputs go unmarked."""
    return rows is not None and rows == _SEQUENCE.static_rows


@contextlib.contextmanager
def static_at(rows: int | None) -> Iterator[None]:
    """Inside, a compiled call of a model batch of `rows` samples runs its static graph (`_StaticGraph`);
    None, or `$AUTOTUNE_COMPILE_STATIC=0`, leaves every call on the dynamic graphs. The training step's
    micro-steps run inside it, at the plan's micro-batch; trials never do (their graphs serve every size)."""
    previous = _SEQUENCE.static_rows
    _SEQUENCE.static_rows = rows if rows is not None and settings.switch(settings.COMPILE_STATIC_ENV) else None
    try:
        yield
    finally:
        _SEQUENCE.static_rows = previous


def _no_kv_cache(model: nn.Module) -> Callable[[], None]:
    """Turn a Hugging Face model's KV cache off while its blocks are compiled; the undo.

    Training never reads the cache, but with it on each block gets its own cache layer, compile guards on
    it, and every block compiles a graph of its own (36 compiles for GPT-2 large instead of one). Hugging
    Face turns it off the same way under gradient checkpointing.
    """
    config: Any = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return lambda: None
    config.use_cache = False

    def restore() -> None:
        config.use_cache = True

    return restore


def graphs_note(blocks: BlockGroup | None, checkpointed: int, tokens: bool) -> str:
    """How many graphs a compiled plan compiles, for its reason."""
    per_block = blocks is not None and bool(blocks.blocks) and not (regions() == "whole" and checkpointed == 0)
    what = "one graph per kind of repeated block" if per_block else "one graph for the whole model"
    dims = "micro-batch size and sequence length" if tokens else "micro-batch size"
    static = (", and training compiles its own shape once more, static"
              if settings.switch(settings.COMPILE_STATIC_ENV) else "")
    return f"compile: {what} for every {dims} (dynamic from the first call){static}"


def regions() -> str:
    """What is compiled when no block is recomputed: "blocks" (default) or "whole" ($AUTOTUNE_COMPILE_REGIONS)."""
    value = settings.read(settings.COMPILE_REGIONS_ENV, "blocks").lower()
    if value not in ("blocks", "whole"):
        raise InvalidSetting(f"$AUTOTUNE_COMPILE_REGIONS must be 'blocks' or 'whole', got {value!r}; unset it for "
                             "'blocks' (each repeated block compiled once, shared by all)")
    return value


def _raise_cache_limits() -> None:
    config = torch_private.dynamo_config()
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(config, name) and getattr(config, name) < _CACHE_LIMIT:
            setattr(config, name, _CACHE_LIMIT)
    if hasattr(config, "accumulated_cache_size_limit"):
        config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, 4 * _CACHE_LIMIT)
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * _CACHE_LIMIT)


def mark_batch_dynamic(batch: object, length: int | None = None) -> None:
    """Tell compile that dim 0 of every input varies, so a new micro-batch size (the next trial, a
    recovery, an uneven last micro-batch) reuses the compiled graph instead of compiling another; and, where
    the model runs a token batch of sequence `length`, every other dim of that size (the sequence in
    hidden states, masks, rotary tables), so each new length reuses it too. A dim marked so that the graph
    fixes anyway (a hidden size that happens to equal the length meets the weights' shapes) is specialized
    by compile without an error: the marks are hints."""
    for t in tensors(batch):
        if t.dim() > 0 and t.shape[0] > 1:  # a size-1 dim is specialized by compile anyway
            torch_private.maybe_mark_dynamic(t, 0)
        if length is not None and length > 1:
            for dim in range(1, t.dim()):
                if t.shape[dim] == length:
                    torch_private.maybe_mark_dynamic(t, dim)


class _SequenceLength:
    """The sequence length and rows of the batch the compiled model is running, set before each forward; and
    the micro-batch whose calls run static graphs (`static_at`), None outside training."""

    length: int | None = None
    rows: int | None = None
    static_rows: int | None = None


_SEQUENCE = _SequenceLength()


def _record_length(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A forward pre-hook: the length of the model's token input (an integer tensor of shape (batch, length)),
    or None for a batch without one (images, features: no sequence to mark); and the batch's rows (`static_at`)."""
    inputs = [t for t in tensors((args, kwargs)) if t.dim() > 0]
    tokens = [t for t in inputs if t.dim() == 2 and not t.is_floating_point()]
    _SEQUENCE.length = int(tokens[0].shape[1]) if tokens else None
    _SEQUENCE.rows = int((tokens or inputs)[0].shape[0]) if inputs else None
