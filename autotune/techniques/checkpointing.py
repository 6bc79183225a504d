"""The checkpointing rung: recompute the model's repeated blocks in backward instead of storing them.

Blocks are found automatically (`blocks.py`): every group of same-class children holding activations (a
transformer's layers, a T5 encoder's and decoder's blocks, a ResNet's bottlenecks in every stage, blocks
held as attributes). Any number of them, 0..N over all groups, may be recomputed (`install(blocks,
count)`), those holding the most activation memory first: the search picks the count from the bytes per
sample measured with none and with all of them recomputed; "selective" is any count between, "full" all.
A module called at several depths (ALBERT's shared layer) has one block per call: k of its N calls are
recomputed, the others run as they are. Checkpointing is non-reentrant (`use_reentrant=False`): it supports
keyword arguments and restores the dropout RNG on recompute. Under activation offload the block's input,
passed first or by keyword (`hidden_states`), is kept on the host. Inside a recomputed block, the plan's
`recompute_policy` says what is kept: nothing ("whole_block"), or the outputs of its matmuls and attention,
so only the cheap operators run again (`recompute_policy.py`: torch's selective checkpoint, searched beside
the block count).

Guards: recomputing a block never changes its state a second time, and the recompute computes with the
state the forward saw, so gradients and buffers are those of no checkpointing. Every buffer in the block's
modules (a parametrization's too: spectral norm's `_u`/`_v`, the hook form's `weight_u`/`weight_v`) that its
forward writes, in place, by reassignment, through `.data` or in a norm layer's kernel, is put back to its
value before the forward for the recompute, and to its value as it is after it (`forward_writes`, which says
how each write is seen). Only the buffers a forward writes are copied, learned on the block's first forward;
norm layers' running statistics (not inputs of a training forward) are copied only around the recompute. A
block whose forward writes what cannot be put back (a parameter in place; a buffer outside the block, seen by
`blocks.profile_blocks`) is not recomputed: the profile leaves it out of the plan's blocks and says why, and
a block found so in training runs plain from then on, with a warning. The block's own forward hooks run
once, because the block's `forward` is what is wrapped, not its `__call__`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..devices.placement import Placement
from .blocks import BlockGroup, find_blocks
from .forward_writes import ForwardWrites, refusal, refuse
from .offload import to_device, to_host
from .recompute_policy import WHOLE_BLOCK, aside, context_fn

__all__ = ["BlockGroup", "find_blocks", "install"]

log = logging.getLogger(__name__)


def install(blocks: BlockGroup, count: int, *, offload_activations: bool, placement: Placement,
            inner: Callable[[nn.Module], Callable[..., Any]] | None = None,
            policy: str = WHOLE_BLOCK) -> Callable[[], None]:
    """Wrap the first `count` blocks' `forward` with non-reentrant checkpointing (a module called at several
    depths: on the calls among them), keeping inside each what `policy` keeps; returns the undo function. `inner`
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
        wrapped = _checkpointed(block, original, offload_activations, placement, policy)
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
                  placement: Placement, policy: str) -> Callable[..., Any]:
    writes = ForwardWrites(block)
    # the selective policy's contexts; none: torch's own (keep nothing but the inputs)
    contexts = context_fn(policy)
    keeps: dict[str, Any] = {} if contexts is None else {"context_fn": contexts}

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or refusal(block):
            return original(*args, **kwargs)
        args, kwargs = _without_kv_cache(args, kwargs)
        key = _input_key(args, kwargs) if offload else None
        if key is None and writes.idle:
            # Nothing to put back or park: a plain checkpoint of the block.
            return checkpoint(original, *args, use_reentrant=False, **keeps, **kwargs)
        calls = [0]
        first_input = [] if key is None else [_argument(args, kwargs, key)]
        wants_grad = bool(first_input) and first_input[0].requires_grad
        record = writes.before()

        def run(*inner: Any, **inner_kwargs: Any) -> Any:
            calls[0] += 1
            if key is not None:
                # Forward uses the device tensor it was given (gradients flow to it directly); the
                # recompute brings the parked copy back. Only the saved values matter in a recompute.
                if first_input:
                    x = first_input.pop()
                else:
                    with aside():  # (not an operator of the block's forward)
                        x = to_device(_argument(inner, inner_kwargs, key), placement.torch_device)
                inner, inner_kwargs = _with_argument(inner, inner_kwargs, key,
                                                     x.requires_grad_(wants_grad) if calls[0] > 1 else x)
            if calls[0] == 1:
                return original(*inner, **inner_kwargs)
            with writes.replayed(record, aside):  # a recompute: the state the forward saw, then the state as it is
                return original(*inner, **inner_kwargs)

        if key is not None:
            # The block's input is the one tensor a checkpointed block keeps alive: keep it on the host.
            args, kwargs = _with_argument(args, kwargs, key, to_host(first_input[0]))
        out = checkpoint(run, *args, use_reentrant=False, **keeps, **kwargs)
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
