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

Batches without a padding mask, each of one length (a stream of packed or truncated sequences whose length
changes from batch to batch), reach attention as causal calls without a mask. A rung applied counts the token
lengths of the batches it is given (`observe`, from `AppliedRung.inputs`); from the second distinct length on,
those calls are padded the same way, so cuDNN sees one shape per 64 tokens there too, and a compiled block
compiles one more graph (at the switch) that serves every later length. Batches of one fixed length are never
padded: their shape repeats, and padding would only add work. No call is padded past the length the plan's
peak was measured at (`fit`'s `max_length`, the trials' batch length; `attention_padding.padding`): the
longest bucket ends there, so no padded step holds more than a trial did.

On by default where cuDNN's attention is enabled on a CUDA device; `AUTOTUNE_ATTENTION_BUCKETS=0` turns it
off, `=1` turns it on on any device (the CPU tests). A function imported by name before the rung was applied
(`from torch.nn.functional import scaled_dot_product_attention`) keeps the original.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import settings
from ..workload.batch import Batch, tokens_per_sample
from . import attention_op, attention_padding
from .attention_padding import MULTIPLE, paddable, padded_call, padding, sdpa


class _Lengths:
    """The token lengths of the batches a rung in force was given: the first, and whether another came since.

    Read by `padded_attention` inside compiled graphs too, where compile guards on `varying`: its change
    compiles each block once more, and the graph compiled then serves every length after it."""

    def __init__(self) -> None:
        self.first: int | None = None
        self.varying = False
        self.longest: int | None = None  # no call is padded past it (`attention_padding.padding`); set by `install`

    def see(self, length: int) -> None:
        if self.first is None:
            self.first = length
        elif length != self.first and not self.varying:
            self.varying = True

    def forget(self) -> None:
        self.first, self.varying = None, False


_LENGTHS = _Lengths()


def observe(batch: Batch) -> None:
    """Count the sequence length of a token batch about to reach the model (see the module's docstring);
    a batch of no tokens counts nothing."""
    length = tokens_per_sample(batch)
    if length is not None:
        _LENGTHS.see(length)


def forget_lengths() -> None:
    """Start the count of lengths again (as applying or removing a rung does)."""
    _LENGTHS.forget()


def lengths_vary() -> bool:
    """Whether the batches under the rung in force have had more than one length."""
    return _LENGTHS.varying


def wanted(device_type: str) -> bool:
    """Whether attention is padded under a rung on this kind of device (see the module's docstring)."""
    on_cuda = device_type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled()
    return settings.switch(settings.ATTENTION_BUCKETS_ENV, default=on_cuda)


def note(device_type: str) -> list[str]:
    """The plan's word on it, where attention is padded."""
    return ([f"masked attention, and causal attention once batches of one length each vary, runs at the length "
             f"rounded up to a multiple of {MULTIPLE} tokens (cuDNN's attention builds a plan per new length; "
             f"{settings.ATTENTION_BUCKETS_ENV}=0 turns this off)"]
            if wanted(device_type) else [])


def install(device_type: str, longest: int | None = None) -> Callable[[], None]:
    """Route `F.scaled_dot_product_attention` through `padded_attention` while a rung is applied, padding no call
    past `longest` tokens (the length the trials measure at, or the plan's `max_length` in training: a call
    padded beyond it would hold more than the plan's peak); the undo puts back the function it found."""
    if not wanted(device_type) or F.scaled_dot_product_attention is padded_attention:
        return lambda: None
    found = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = padded_attention
    _LENGTHS.forget()
    _LENGTHS.longest = longest

    def undo() -> None:
        F.scaled_dot_product_attention = found
        attention_padding.forget_masks()
        _LENGTHS.forget()  # the next rung's batches start their own count
        _LENGTHS.longest = None

    return undo


def padded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                     scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """`scaled_dot_product_attention` over the length rounded up to `MULTIPLE`, sliced back to the given one."""
    compiling = torch.compiler.is_compiling()
    # (compiled, the length is symbolic: a test of it would guard the graph on it, and a padding of 0 is cheap)
    padded = paddable(query, key, attn_mask, is_causal=is_causal, lengths_vary=_LENGTHS.varying)
    if not padded or (not compiling and padding(query.shape[-2], _LENGTHS.longest) == 0):
        return sdpa(query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    if compiling:  # (`longest` is a constant of the graph: one value per plan, the trials' and training's alike)
        return attention_op.padded_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                             _LENGTHS.longest)
    return padded_call(query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                       enable_gqa=enable_gqa, longest=_LENGTHS.longest)
