"""The padded attention call itself: queries, keys and values padded to a multiple of `MULTIPLE` tokens, the
mask widened to match, the output sliced back to the given length.

Nothing a real position computes changes: the padded keys are masked for every real query (by the causal mask
past the last real position, or by mask columns of `False` / the dtype's minimum), the padded queries attend
to the real keys only (so their rows stay finite) and their outputs are dropped, so their gradients are zero.
A real query row that the given mask hides entirely (padding beyond a sliding window) is opened to the real keys
as well: no kernel then returns NaN for it, and its output reaches no real position.
Dropout draws for the padded shape, the same distribution over the real positions.

`paddable` says which calls are padded: self-attention (as many keys as queries), not nested, either masked
(a mask over every key) or causal without a mask once the batches' lengths vary. A padding mask is what batches
padded to their longest sample bring, and with it a new length almost every step. A causal call without a mask
comes from batches of one length each: where that length is fixed, every step's shape is the same and padding
would only add work, so such a call is padded only after a second length was seen (`attention_lengths`); the
causal mask hides the padded keys from every real query as a padding mask would. (On an H200 with torch 2.11
both the masked and the unmasked causal call ran cuDNN's kernels, which build a plan per length.) A non-causal
call without a mask is never padded: its real queries would see the padded keys.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

MULTIPLE = 64  # tokens: cuDNN's and flash attention's tile, so the padded rows add almost no attention work
original = F.scaled_dot_product_attention  # torch's own, whatever is installed in its place later


def paddable(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, *, is_causal: bool = False,
             lengths_vary: bool = False) -> bool:
    """Whether the call is padded: masked self-attention, or causal self-attention without a mask where
    `lengths_vary` (see the module's docstring)."""
    if query.is_nested or query.dim() < 3 or query.shape[-2] != key.shape[-2]:
        return False
    if mask is None:
        return is_causal and lengths_vary
    return mask.dim() >= 2 and mask.shape[-1] == key.shape[-2] and mask.shape[-2] in (1, query.shape[-2])


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None, *,
         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
         enable_gqa: bool = False) -> torch.Tensor:
    """torch's own `scaled_dot_product_attention`, as given."""
    return original(query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)


def padding(length: int, longest: int | None = None) -> int:
    """The tokens a call of `length` is padded by: up to the next multiple of `MULTIPLE`, but never past `longest`,
    the length the plan's peak was measured at (`fit`'s `max_length`), where `length` is within it: a bucket
    beyond it would hold more than any trial did. Longer calls than `longest` take their bucket."""
    pad = (-length) % MULTIPLE
    return min(pad, longest - length) if longest is not None and length <= longest else pad


def padded_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None, *,
                dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False, longest: int | None = None) -> torch.Tensor:
    """torch's `scaled_dot_product_attention` over the length rounded up to `MULTIPLE` (`padding`), sliced back."""
    length = query.shape[-2]
    pad = padding(length, longest)
    if pad == 0:
        return sdpa(query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
    mask = None if attn_mask is None else _MASKS.padded(attn_mask, length, pad)
    out = sdpa(q, k, v, mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return out[..., :length, :]


class _LastMask:
    """The last mask padded and its padded form: a model hands the same mask to every layer (and its backward
    hands it back), so one padding serves a whole step instead of one per layer.

    A compiled graph may hand each layer another tensor over the same memory, so the mask is known by its
    memory, shape, strides and version; the entry holds the mask it was made from, so that memory cannot be
    freed and reused by another mask while the entry stands, and a mask written in place has another version."""

    def __init__(self) -> None:
        self._source: torch.Tensor | None = None
        self._key: tuple[Any, ...] = ()
        self._padded: torch.Tensor | None = None

    def padded(self, mask: torch.Tensor, length: int, pad: int) -> torch.Tensor:
        if mask.requires_grad:  # a learned bias: its padding must stay in the autograd graph
            return _padded_mask(mask, length, pad)
        key = (mask.data_ptr(), mask.shape, mask.stride(), mask.dtype, mask.device, mask._version, pad)
        if self._padded is None or self._key != key:
            self._source, self._key, self._padded = mask, key, _padded_mask(mask, length, pad)
        return self._padded

    def forget(self) -> None:
        """Let the last mask go (when the padding is removed: its memory is not the next trial's)."""
        self._source, self._key, self._padded = None, (), None


_MASKS = _LastMask()


def forget_masks() -> None:
    """Drop the mask kept for the next layer (`_LastMask`)."""
    _MASKS.forget()


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
    # A query row the model's own mask hides entirely (a padding position beyond a sliding window) has no
    # defined attention: torch's kernels at the unpadded length return a finite row, cuDNN's at the padded
    # one NaN, whose gradient then spreads to every weight. Such a row sees the real keys instead; its output
    # reaches no real position (its key is hidden from every real query), so no real gradient changes.
    dead = (~mask if mask.dtype == torch.bool else mask <= hidden).all(dim=-1, keepdim=True)
    mask = torch.where(dead, row, mask)
    rows = row.expand(*mask.shape[:-2], pad, length + pad)
    return torch.cat([mask, rows], dim=-2)
