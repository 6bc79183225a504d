"""The compile knob: `torch.compile` on the model, composed with checkpointing the way it pays.

When no block is recomputed the whole model is compiled (one graph, the most fusion). When some are, each
repeated block is compiled on its own, around its checkpoint wrapper when it has one, so the recompute in
backward runs the same fused kernels (torchtitan compiles per block for the same reason); the rest of
the model stays eager. Identical blocks share one compiled graph (their parameters are graph inputs).

Compile is a speed and a memory technique: fused kernels keep fewer intermediates (GPT-2 large on an
H100: 10.5 GiB where eager peaked at 21.2 at the same micro-batch). Its cost is compile time, paid at
the first step of each new shape; torch's own on-disk caches (Inductor's FX graph cache) make a second
tune of the same model cheaper. After the second shape torch marks the batch dimension dynamic, so a
change of micro-batch in training (recovery, an uneven last micro-batch) does not recompile again.

Compiling this way (what `nn.Module.compile()` does) keeps the module object and its state dict as they
are, and is undone by dropping the compiled call; a model that cannot be compiled falls back to eager with a note (the search records
the failed trial and goes on without compile).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from ..devices.placement import Placement
from ..workload.batch import tensors
from .checkpointing import BlockGroup

# Each trial of a new configuration may add a guard set per compiled code object (shapes, checkpointed or
# not); the default of 8 would send a long search back to eager silently.
_CACHE_LIMIT = 64


def unavailable(placement: Placement) -> str | None:
    """Why compile cannot be searched here, or None when it can."""
    if placement.simulated:
        return "compile left out on the simulated CPU device (it measures nothing there but compile time)"
    try:
        from torch.utils._triton import has_triton
    except ImportError:  # pragma: no cover - very old torch
        return "compile left out: this torch has no Triton check"
    if not has_triton():
        return "compile left out: Triton is not installed for this GPU (pip install triton)"
    return None


def install(model: nn.Module, blocks: BlockGroup | None, checkpointed: int) -> Callable[[], None]:
    """Compile `model` (whole) or its blocks (when `checkpointed` > 0); returns the undo function."""
    _raise_cache_limits()
    targets = list(blocks.blocks) if checkpointed > 0 and blocks is not None else [model]
    for module in targets:
        module._compiled_call_impl = _compiled(module)  # what nn.Module.compile() sets

    def remove() -> None:
        for module in targets:
            module._compiled_call_impl = None  # what nn.Module.compile set; __call__ is eager again

    return remove


# One compiled callable per module, reused by every trial and by training: a fresh torch.compile wrapper
# brings a fresh backend, whose guard would miss every graph compiled before and compile them again.
_WRAPPERS: weakref.WeakKeyDictionary[nn.Module, Callable[..., object]] = weakref.WeakKeyDictionary()


def _compiled(module: nn.Module) -> Callable[..., object]:
    if module not in _WRAPPERS:
        _WRAPPERS[module] = torch.compile(module._call_impl)
    return _WRAPPERS[module]


def _raise_cache_limits() -> None:
    config = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(config, name) and getattr(config, name) < _CACHE_LIMIT:
            setattr(config, name, _CACHE_LIMIT)
    if hasattr(config, "accumulated_cache_size_limit"):
        config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, 4 * _CACHE_LIMIT)
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * _CACHE_LIMIT)


def mark_batch_dynamic(batch: object) -> None:
    """Tell compile that dim 0 of every input varies, so a new micro-batch size (the next trial, a
    recovery, an uneven last micro-batch) reuses the compiled graph instead of compiling another."""
    for t in tensors(batch):
        if t.dim() > 0 and t.shape[0] > 1:  # a size-1 dim is specialized by compile anyway
            torch._dynamo.maybe_mark_dynamic(t, 0)
