"""The padded attention as one operator of a compiled graph (`autotune::padded_attention`).

Padded with torch operations inside a graph, the padded length is an expression of the dynamic one, and
autotune's compiled GPT-2 trials failed in Inductor; an eager call between graphs instead breaks each block's
graph in two (docs/variable-lengths.md). Registered as a custom operator, the padded call is a single node that Inductor
calls as it is: one graph per block still serves every length, and cuDNN sees one shape per `MULTIPLE` tokens.

The operator saves its inputs, not the attention's own intermediates: its backward runs the padded attention
again under `torch.func.vjp` (the forward once more, then its backward), from the random state the forward's
dropout drew from, so the gradients are those of the forward that ran. That costs one more attention forward
per call, small beside the 0.5 s a new length costs cuDNN.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .attention_padding import padded_call


def padded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                     dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
                     longest: int | None = None) -> torch.Tensor:
    """`padded_call` as one graph node (padded never past `longest`: `padding`). Autocast is
    applied here, as it would be to torch's attention: the operator's backward runs where autocast is off."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (t.to(dtype) for t in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(dtype)
    with torch.autocast(device, enabled=False):
        out, _ = _forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, longest)
    return out


@torch.library.custom_op("autotune::padded_attention", mutates_args=())
def _forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
             dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
             longest: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The output (contiguous, as the graph was told) and the random state its dropout drew from (empty
    without dropout)."""
    state = _rng_state(query.device) if dropout_p > 0 else torch.empty(0, dtype=torch.uint8)
    out = padded_call(query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                      enable_gqa=enable_gqa, longest=longest)
    return out.contiguous(), state


@_forward.register_fake
def _forward_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                   dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
                   longest: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))
    return out, torch.empty(_rng_state(query.device).numel() if dropout_p > 0 else 0, dtype=torch.uint8)


@torch.library.custom_op("autotune::padded_attention_backward", mutates_args=())
def _backward_op(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None, state: torch.Tensor, dropout_p: float, is_causal: bool,
                 scale: float | None, enable_gqa: bool,
                 longest: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of query, key and value: the padded call run again under `torch.func.vjp`, with the
    forward's random state."""
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return padded_call(q, k, v, attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                           enable_gqa=enable_gqa, longest=longest)

    with _replayed(state, query.device):
        vjp: Any = torch.func.vjp(attention, query, key, value)[1]  # (typed by torch as any number of outputs)
        dq, dk, dv = vjp(grad.contiguous())
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_backward_op.register_fake
def _backward_shape(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None, state: torch.Tensor, dropout_p: float, is_causal: bool,
                    scale: float | None, enable_gqa: bool,
                    longest: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _save(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, longest = inputs
    ctx.save_for_backward(query, key, value, attn_mask, output[1])
    ctx.options = (dropout_p, is_causal, scale, enable_gqa, longest)  # type: ignore[attr-defined]


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor,
              _state_grad: object) -> tuple[torch.Tensor | None, ...]:
    query, key, value, attn_mask, state = ctx.saved_tensors  # type: ignore[attr-defined]
    grads = _backward_op(grad, query, key, value, attn_mask, state, *ctx.options)  # type: ignore[attr-defined]
    return (*grads, None, None, None, None, None, None)


_forward.register_autograd(_backward, setup_context=_save)


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


@contextlib.contextmanager
def _replayed(state: torch.Tensor, device: torch.device) -> Iterator[None]:
    """The random state set to `state` (where the forward drew dropout) and put back after."""
    if state.numel() == 0:
        yield
        return
    now = _rng_state(device)
    set_state = (lambda s: torch.cuda.set_rng_state(s, device)) if device.type == "cuda" else torch.set_rng_state
    set_state(state)
    try:
        yield
    finally:
        set_state(now)
