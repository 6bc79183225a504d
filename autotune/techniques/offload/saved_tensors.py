"""Which saved tensors saved-activation offload moves (`activations.py`), and how their bytes are viewed again.

A tensor moves when it holds at least `MIN_BYTES`, is dense (its values copy as one span) and is not a weight
as a matmul saves it (a parameter through casts, transposes and views: the model holds it anyway).
"""

from __future__ import annotations

import torch

MIN_BYTES = 64 << 10  # a saved tensor under 64 KiB stays on the device: the copy's fixed cost outweighs it
# The autograd nodes between a weight and what a matmul saves of it (an autocast copy, a transpose, a view).
_WEIGHT_PATH = frozenset({"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0",
                          "ViewBackward0", "UnsafeViewBackward0", "ExpandBackward0", "AliasBackward0"})


def as_layout(buffer: torch.Tensor, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Raw bytes viewed as a tensor of `shape` and `stride` (a dense layout, so it spans exactly its bytes)."""
    return buffer.view(dtype).as_strided(shape, stride)


def dense(t: torch.Tensor) -> bool:
    """Whether `t` covers its elements once each with no gaps (contiguous in some order of its dimensions):
    its values copy as one span, and a tensor of its strides holds nothing more."""
    expected = 1
    for d in sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d))):
        if t.size(d) == 1:
            continue
        if t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def from_weight(t: torch.Tensor) -> bool:
    """Whether `t` is a weight as a matmul saves it: a parameter through casts, transposes and views only."""
    node = t.grad_fn
    for _ in range(4):
        if node is None:
            return False
        if type(node).__name__ == "AccumulateGrad":
            return True
        if type(node).__name__ not in _WEIGHT_PATH:
            return False
        nexts = [n for n, _ in node.next_functions if n is not None]
        node = nexts[0] if len(nexts) == 1 else None
    return False
