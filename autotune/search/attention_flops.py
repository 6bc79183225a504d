"""FLOPs of torch's fused attention kernels, grouped-query attention included.

`FlopCounterMode` counts `scaled_dot_product_attention` by its fused kernels (flash, memory-efficient, cuDNN).
Before torch 2.13 their formulas required as many key/value heads as query heads, so a model with grouped-
query attention (Llama 3, Mistral, Qwen: 8 key/value heads for 32 query heads) failed the count and got no
MFU; and the CPU's flash kernel has no formula at all, so attention counted as nothing there. The kernels
broadcast each key/value head over its group of query heads, so the work is that of full attention over the
query heads: these formulas count it so, on every torch the package supports.

Matmuls of (b, n, k) by (b, k, m) cost 2·b·n·k·m FLOPs. Forward: scores QKᵀ and the output PV. Backward: the
scores again, then the gradients of P (dO·Vᵀ), V (Pᵀ·dO), Q (dS·K) and K (dSᵀ·Q). Causal masking is not
discounted, as torch does not discount it either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

aten = torch.ops.aten

Shape = Sequence[int]


def _matmul(batch: int, n: int, k: int, m: int) -> int:
    return 2 * batch * n * k * m


def _heads(query: Shape, key: Shape, value: Shape) -> tuple[int, int, int, int, int]:
    """(batch·query heads, query length, key length, head dim of q/k, head dim of v), checked."""
    b, h_q, s_q, d_qk = query
    b_k, h_k, s_k, d_k = key
    b_v, h_v, s_v, d_v = value
    if not (b == b_k == b_v and h_k == h_v and s_k == s_v and d_qk == d_k and h_k and h_q % h_k == 0):
        raise ValueError(f"attention shapes do not match: query {tuple(query)}, key {tuple(key)}, "
                         f"value {tuple(value)}")
    return b * h_q, s_q, s_k, d_qk, d_v


def attention_forward(query: Shape, key: Shape, value: Shape, *args: Any, out_shape: Any = None,
                      **kwargs: Any) -> int:
    bh, s_q, s_k, d, d_v = _heads(query, key, value)
    return _matmul(bh, s_q, d, s_k) + _matmul(bh, s_q, s_k, d_v)


def attention_backward(grad_out: Shape, query: Shape, key: Shape, value: Shape, *args: Any,
                       out_shape: Any = None, **kwargs: Any) -> int:
    bh, s_q, s_k, d, d_v = _heads(query, key, value)
    scores = _matmul(bh, s_q, d, s_k)
    grad_probs, grad_value = _matmul(bh, s_q, d_v, s_k), _matmul(bh, s_k, s_q, d_v)
    grad_query, grad_key = _matmul(bh, s_q, s_k, d), _matmul(bh, d, s_q, s_k)
    return scores + grad_probs + grad_value + grad_query + grad_key


def _formulas() -> dict[Any, Callable[..., int]]:
    forward = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    table: dict[Any, Callable[..., int]] = {}
    for name in forward:
        for op, formula in ((name, attention_forward), (f"{name}_backward", attention_backward)):
            if hasattr(aten, op):  # each kernel exists from some torch version on
                table[getattr(aten, op)] = formula
    return table


ATTENTION_FORMULAS = _formulas()
