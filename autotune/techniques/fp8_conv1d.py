"""Float8 training for transformers' `Conv1D` (GPT-2's attention and MLP), which torchao does not convert.

`Conv1D` is a linear layer whose weight is stored transposed: `y = x @ W + b` with `W` of shape (in, out).
torchao's `Float8Linear` computes `x @ weight.t()` through one autograd function that takes the weight already
transposed, so a `Conv1D` hands it its own weight as it is: the same float8 casts, matmuls and gradients as a
`Float8Linear` holding `W.t()`, with the user's `Parameter` (and its name in the state dict) untouched.

The autograd function and its matmul settings are torchao's internals (`torchao.float8.float8_linear`): where a
torchao release lacks them, `supported()` is False and these layers stay in bf16, which the plan's reason says.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn


def is_conv1d(module: nn.Module) -> bool:
    """Whether `module` is a transformers-style `Conv1D`: named so, `nf` output features, a 2-D (in, out) weight.
    Recognised by shape rather than by import, so choosing layers never imports transformers."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)
            and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[1] == module.nf)


def features(module: nn.Module) -> tuple[int, int]:
    """A `Conv1D`'s (in, out) features."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return int(weight.shape[0]), int(weight.shape[1])


def _internals() -> Any | None:
    """torchao's float8 linear module where it has what this layer needs, else None."""
    try:
        module = importlib.import_module("torchao.float8.float8_linear")
    except ImportError:
        return None
    needed = ("Float8Linear", "matmul_with_hp_or_float8_args")
    return module if all(hasattr(module, name) for name in needed) else None


def supported() -> bool:
    """Whether the installed torchao can serve `Conv1D` layers (imports torchao)."""
    return _internals() is not None


class Float8Conv1D(nn.Module):
    """A `Conv1D` whose three matmuls run in float8, holding the original layer's weight and bias."""

    def __init__(self, conv: nn.Module, config: Any) -> None:
        super().__init__()
        internals = _internals()
        if internals is None:
            raise RuntimeError("this torchao release has no float8 matmul for Conv1D layers (fp8_conv1d.supported)")
        self._matmul = internals.matmul_with_hp_or_float8_args
        in_features, out_features = features(conv)
        self.nf, self.nx = out_features, in_features
        self.weight = conv.weight  # the same Parameter objects: the optimizer and the state dict see no change
        self.bias = conv.bias
        # torchao's own settings for the three matmuls, built the way it builds them for a linear layer of
        # this shape (on the meta device: no memory)
        with torch.device("meta"):
            shell = internals.Float8Linear.from_float(nn.Linear(in_features, out_features, bias=False), config)
        self.linear_mm_config = shell.linear_mm_config
        self.config = shell.config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled("cuda"):  # as Float8Linear does: the matmul runs on autocast's dtype
            x = x.to(torch.get_autocast_dtype("cuda"))
        out = self._matmul.apply(x, self.weight, self.linear_mm_config, self.config)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, float8"
