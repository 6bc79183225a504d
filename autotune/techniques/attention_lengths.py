"""Attention over a few sequence lengths: `scaled_dot_product_attention` padded to a multiple of `MULTIPLE` tokens.

cuDNN's attention, which torch picks on recent GPUs for masked training attention, builds an execution plan
for every new shape, a cost paid once per length that can double a step (benchmarks/RESULTS.md, "Real training
data"). Padded batches bring a new length almost every step.
While a rung is applied, `torch.nn.functional.scaled_dot_product_attention` pads the queries, keys and values
of a masked self-attention call (what padded batches bring) to the next multiple of `MULTIPLE` and slices the
output back (`attention_padding`): every other layer runs at the batch's own length, and cuDNN sees at most
one shape per 64 tokens. Eager calls pad in place; a compiled graph calls the padded attention as one operator
(`attention_op`), so one graph still serves every length. Other calls run as given
(`attention_padding.paddable` says why).

On by default where cuDNN's attention is enabled on a CUDA device; `AUTOTUNE_ATTENTION_BUCKETS=0` turns it
off, `=1` turns it on on any device (the CPU tests). A function imported by name before the rung was applied
(`from torch.nn.functional import scaled_dot_product_attention`) keeps the original.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import settings
from . import attention_op, attention_padding
from .attention_padding import MULTIPLE, paddable, padded_call, sdpa


def wanted(device_type: str) -> bool:
    """Whether attention is padded under a rung on this kind of device (see the module's docstring)."""
    on_cuda = device_type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled()
    return settings.switch(settings.ATTENTION_BUCKETS_ENV, default=on_cuda)


def note(device_type: str) -> list[str]:
    """The plan's word on it, where attention is padded."""
    return ([f"masked attention runs at the length rounded up to a multiple of {MULTIPLE} tokens (cuDNN's attention "
             f"builds a plan per new length; {settings.ATTENTION_BUCKETS_ENV}=0 turns this off)"]
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
        attention_padding.forget_masks()

    return undo


def padded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                     scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """`scaled_dot_product_attention` over the length rounded up to `MULTIPLE`, sliced back to the given one."""
    compiling = torch.compiler.is_compiling()
    # (compiled, the length is symbolic: a test of it would guard the graph on it, and a padding of 0 is cheap)
    if not paddable(query, key, attn_mask) or (not compiling and query.shape[-2] % MULTIPLE == 0):
        run = sdpa
    elif compiling:
        return attention_op.padded_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    else:
        run = padded_call
    return run(query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
               enable_gqa=enable_gqa)
