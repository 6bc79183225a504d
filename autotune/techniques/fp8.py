"""The FP8 knob: torchao's float8 training of the model's linear layers (`techniques=(..., "fp8")`, opt-in).

Each chosen `nn.Linear` becomes torchao's `Float8Linear`: its three matmuls (the forward, and backward's two)
run in float8 with dynamic tensor-wise scales, on the tensor cores of CUDA compute capability 8.9 and later
(Ada, Hopper and later). The weights, their gradients and the optimizer are untouched: the converted layer holds
the same `Parameter` objects, so the optimizer and `state_dict` see the real values. The matmuls round to
float8, so the knob changes the numerics: it is never in the default set, and only bf16 configurations get an
fp8 twin, which the search measures beside the one without (the plan's name says "fp8" when it won).

A layer is converted only where float8's matmul serves its shape: in and out features each a multiple of
`MULTIPLE`. The others stay in bf16, and the plan's reason says how many. Transformers' `Conv1D` (GPT-2's
attention and MLP: a linear layer with its weight stored transposed) is converted too, by `fp8_conv1d`. The
token dimension, an inner dimension of the weight gradient's matmul, is padded to `MULTIPLE` by torchao, since a
batch's tokens need not divide.

Left out with the reason in the plan's on the CPU and on GPUs below 8.9; refused (`InvalidSetting`) where
the GPU has float8 but torchao is not importable. Checking the hardware and choosing the layers import
nothing of torchao.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..devices.placement import Placement
from ..errors import InvalidSetting
from . import fp8_conv1d

MIN_CAPABILITY = (8, 9)  # CUDA compute capability of the first float8 tensor cores (Ada)
MULTIPLE = 16  # float8 matmul (`torch._scaled_mm`) wants each dimension of its operands a multiple of this
INSTALL = "pip install torchao (what the 'fp8' extra installs: pip install -e \".[fp8]\")"


@dataclass(frozen=True, kw_only=True, slots=True)
class Layers:
    """The model's linear layers by module path: those float8 serves, and those left in bf16."""

    converted: tuple[str, ...]
    left: tuple[str, ...]
    why_left: str = f"in or out features not divisible by {MULTIPLE}"

    def note(self) -> str:
        """The plan's word on it."""
        total = len(self.converted) + len(self.left)
        if not self.converted:
            return f"fp8 left out: none of the model's {total} linear layers is served ({self.why_left})"
        left = f" ({len(self.left)} left in bf16: {self.why_left})" if self.left else ""
        return f"fp8 tried on {len(self.converted)} of {total} linear layers{left}"


def unavailable(placement: Placement) -> str | None:
    """Why fp8 cannot be searched here, or None where the device has float8 matmuls."""
    wanted = ".".join(map(str, MIN_CAPABILITY))
    if placement.simulated or placement.kind != "cuda":
        return (f"fp8 left out: float8 training needs a CUDA GPU of compute capability {wanted} or later "
                f"(Ada, Hopper); this is {placement.name or placement.kind}")
    capability = torch.cuda.get_device_capability(placement.index)
    if capability < MIN_CAPABILITY:
        return (f"fp8 left out: float8 training needs CUDA compute capability {wanted} or later (Ada, Hopper); "
                f"{placement.name} is {capability[0]}.{capability[1]}")
    return None


def is_linear(module: nn.Module) -> bool:
    """Whether `module` computes a linear layer: an `nn.Linear` (subclasses too, as torchao swaps them) or a
    transformers-style `Conv1D`."""
    return isinstance(module, nn.Linear) or fp8_conv1d.is_conv1d(module)


def servable(module: nn.Module) -> bool:
    """Whether `module` is a linear layer whose shape float8's matmul serves."""
    if isinstance(module, nn.Linear):
        in_features, out_features = module.in_features, module.out_features
    elif fp8_conv1d.is_conv1d(module):
        in_features, out_features = fp8_conv1d.features(module)
    else:
        return False
    return in_features % MULTIPLE == 0 and out_features % MULTIPLE == 0


def layers(model: nn.Module, *, conv1d: bool = True) -> Layers:
    """The model's linear layers (`is_linear`), split by `servable`; `Conv1D` layers are left in bf16 where
    `conv1d` is False (a torchao without what `fp8_conv1d` needs)."""
    linear = [(name, m) for name, m in model.named_modules() if is_linear(m)]
    chosen = [name for name, m in linear if servable(m) and (conv1d or not fp8_conv1d.is_conv1d(m))]
    why = "" if conv1d else ", or a Conv1D, which this torchao's float8 cannot serve (upgrade torchao)"
    return Layers(converted=tuple(chosen), left=tuple(name for name, _ in linear if name not in chosen),
                  why_left=f"in or out features not divisible by {MULTIPLE}{why}")


def served(model: nn.Module) -> Layers:
    """`layers` as the installed torchao serves them: its `Conv1D` layers left in bf16 where it cannot (imports
    torchao; `layers` alone does not)."""
    return layers(model, conv1d=fp8_conv1d.supported())


def require() -> Any:
    """torchao's float8 training module; InvalidSetting naming the extra when it is not importable."""
    try:
        return importlib.import_module("torchao.float8")
    except ImportError as e:
        raise InvalidSetting(f"techniques: 'fp8' needs torchao's float8 training, which is not importable ({e}). "
                             f"Install it ({INSTALL}), or leave 'fp8' out of techniques") from e


def install(model: nn.Module) -> Callable[[], None]:
    """Convert the servable linear layers of `model` to float8 training; the undo puts the original modules
    back (they hold the same parameters, trained meanwhile)."""
    float8 = require()
    chosen = {name for name in served(model).converted if name}  # (the model itself is not swapped in place)
    named = dict(model.named_modules())
    originals = {name: named[name] for name in chosen}
    config = float8.Float8LinearConfig(pad_inner_dim=True)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: (
        name in chosen and isinstance(module, nn.Linear)))
    for name in sorted(n for n in chosen if fp8_conv1d.is_conv1d(originals[n])):
        _swap(model, name, fp8_conv1d.Float8Conv1D(originals[name], config))

    def undo() -> None:
        for name, module in originals.items():
            _swap(model, name, module)

    return undo


def _swap(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` at `name` (a dotted path below `model`)."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)
