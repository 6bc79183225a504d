"""Attention over a few sequence lengths: `scaled_dot_product_attention` padded to a multiple of `MULTIPLE` tokens.

cuDNN's attention, which torch picks on recent GPUs for masked training attention, builds an execution plan
for every new shape, a cost paid once per length that can double a step (benchmarks/RESULTS.md, "Real training
data"). Padded batches bring a new length almost every step.
While a rung is applied, `torch.nn.functional.scaled_dot_product_attention` pads the queries, keys and values
of a self-attention call to the next multiple of `MULTIPLE` and slices the output back: every other layer runs
at the batch's own length, and cuDNN sees at most one shape per 64 tokens.

Nothing a real position computes changes: the padded keys are masked for every real query (by the causal mask
past the last real position, or by mask columns of `False` / the dtype's minimum), the padded queries
attend to the real keys only (so their rows stay finite) and their outputs are dropped, so their gradients
are zero. Dropout draws for the padded shape, the same distribution over the real positions.

Only eager calls are padded (a compiled graph calls attention at the batch's own length, `_padded` says why),
and only where the above holds: self-attention (as many keys as queries), causal without a mask or
with a mask over every key, not nested. Where the mask is neither (`is_causal=False` and no mask), padding
would let real queries see the padded keys, so the call runs as given.

On by default where cuDNN's attention is enabled on a CUDA device; `AUTOTUNE_ATTENTION_BUCKETS=0` turns it
off, `=1` turns it on on any device (the CPU tests). A function imported by name before the rung was applied
(`from torch.nn.functional import scaled_dot_product_attention`) keeps the original.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .. import settings

MULTIPLE = 64  # tokens: cuDNN's and flash attention's tile, so the padded rows add almost no attention work
_original = F.scaled_dot_product_attention


def wanted(device_type: str) -> bool:
    """Whether attention is padded under a rung on this kind of device (see the module's docstring)."""
    on_cuda = device_type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled()
    return settings.switch(settings.ATTENTION_BUCKETS_ENV, default=on_cuda)


def note(device_type: str) -> list[str]:
    """The plan's word on it, where attention is padded."""
    return ([f"eager attention runs at the length rounded up to a multiple of {MULTIPLE} tokens, compiled attention "
             f"at the batch's own (cuDNN's attention builds a plan per new length; {settings.ATTENTION_BUCKETS_ENV}=0 "
             f"turns this off)"]
            if wanted(device_type) else [])


def install(device_type: str) -> Callable[[], None]:
    """Route `F.scaled_dot_product_attention` through `padded_attention` while a rung is applied; the undo puts
    back the function it found."""
    if not wanted(device_type) or F.scaled_dot_product_attention is padded_attention:
        return lambda: None
    found = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = padded_attention

    def undo() -> None:
        F.scaled_dot_product_attention = found

    return undo


def padded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`scaled_dot_product_attention` over the length rounded up to `MULTIPLE`, sliced back to the given one."""
    if torch.compiler.is_compiling():  # compiled attention is left as it is: see `_padded`
        return _original(query, key, value, attn_mask, *args, **kwargs)
    is_causal = kwargs.get("is_causal", args[1] if len(args) > 1 else False)
    if query.shape[-2] % MULTIPLE == 0 or not _paddable(query, key, attn_mask, is_causal):
        return _original(query, key, value, attn_mask, *args, **kwargs)
    return _padded(query, key, value, attn_mask, *args, **kwargs)


def _padded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
            *args: Any, **kwargs: Any) -> torch.Tensor:
    """The padded call, for eager attention only: Inductor does not lower the fused attention kernels over a
    padded dynamic length, and an eager call between compiled graphs breaks each block's graph
    (docs/variable-lengths.md)."""
    length = query.shape[-2]
    pad = (-length) % MULTIPLE
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
    mask = None if attn_mask is None else _padded_mask(attn_mask, length, pad)
    out = _original(q, k, v, mask, *args, **kwargs)
    return out[..., :length, :]


def _paddable(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, is_causal: Any) -> bool:
    if query.is_nested or query.dim() < 3 or query.shape[-2] != key.shape[-2]:
        return False
    if mask is None:
        return bool(is_causal)  # without a mask only the causal one hides the padded keys
    return mask.dim() >= 2 and mask.shape[-1] == key.shape[-2] and mask.shape[-2] in (1, query.shape[-2])


def _padded_mask(mask: torch.Tensor, length: int, pad: int) -> torch.Tensor:
    """`mask` over `length + pad` keys (the padded ones hidden) and, where it has a row per query, `pad` more
    rows that see the real keys only."""
    hidden: bool | float = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
    seen: bool | float = True if mask.dtype == torch.bool else 0.0
    mask = F.pad(mask, (0, pad), value=hidden)
    if mask.shape[-2] == 1:
        return mask
    row = torch.full((length + pad,), hidden, dtype=mask.dtype, device=mask.device)
    row[:length] = seen
    rows = row.expand(*mask.shape[:-2], pad, length + pad)
    return torch.cat([mask, rows], dim=-2)
