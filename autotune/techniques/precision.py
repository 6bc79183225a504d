"""The precision rung: BF16 autocast, FP16 autocast with a GradScaler where BF16 is unsupported, or FP32.

Autocast keeps the FP32 weights and casts per operator, so it changes what is stored for backward
(activations in 16 bits: about half the activation memory) without touching the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from .. import settings
from ..devices import placement as cpu_features
from ..devices.placement import NO_NATIVE_BF16, Placement, bf16_supported
from ..settings import CPU_BF16_ENV

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def choose_precision(allow_16bit: bool, placement: Placement) -> tuple[str, str]:
    """(precision, reason). BF16 when allowed and supported; FP16 when only that is (a GPU); else FP32."""
    if not allow_16bit:
        return "fp32", "fp32: 'bf16' is not among the allowed techniques"
    if placement.simulated:  # fp16 on a CPU is emulated as well: bf16 or fp32
        native = cpu_features.cpu_has_native_bf16()  # read once: the switch's default and the reason agree
        if not settings.cpu_bf16(native):
            return "fp32", f"fp32: {NO_NATIVE_BF16 if not native else f'{CPU_BF16_ENV}=0'}"
        return "bf16", (f"bf16: supported on {placement.name}" if native else
                        f"bf16: {CPU_BF16_ENV}=1, though this CPU emulates it (slower than fp32)")
    if bf16_supported(placement):
        return "bf16", f"bf16: supported on {placement.name}"
    return "fp16", f"fp16 with loss scaling: {placement.name} has no bf16 support"


def autocast_factory(precision: str, placement: Placement) -> Callable[[], contextlib.AbstractContextManager[object]]:
    """A zero-argument callable returning the autocast context for one forward (a null context for FP32)."""
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = _DTYPES[precision]
    device_type = placement.torch_device.type
    return lambda: torch.autocast(device_type=device_type, dtype=dtype)


def make_scaler(precision: str, placement: Placement) -> torch.amp.GradScaler | None:
    """FP16 needs dynamic loss scaling (its range underflows small gradients); BF16 and FP32 do not."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(placement.torch_device.type)
