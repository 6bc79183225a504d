"""The 8-bit optimizer knob: AdamW whose two moments are kept in 8 bits (block-wise quantized).

AdamW keeps 8 bytes of state a parameter in FP32; 8-bit state keeps 2 (plus a scale per block of 256),
so a device-stepped model needs about 10 bytes a parameter instead of 16. It changes the numerics, so it
is opt-in: `techniques=(..., "optimizer_8bit")`, never in the default set.

Implementations, the first importable wins: torchao's `AdamW8bit` / `Adam8bit` (pure PyTorch tensor
subclasses, CPU and CUDA), then bitsandbytes' (CUDA only). Neither is a dependency: the `optim8bit` extra
brings torchao (`pip install torchao`). Only Adam and AdamW have an 8-bit form; another optimizer class
leaves the knob out with a note.

torchao steps each parameter through `torch.compile`; on the simulated CPU device that cannot run under the
memory ceiling's dispatch mode, so there (and only there) the step runs eagerly: the same arithmetic.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import InvalidSetting
from ..workload.optimizers import OptimizerSpec

PACKAGES = ("torchao", "bitsandbytes")
_CLASSES = {"AdamW": "AdamW8bit", "Adam": "Adam8bit"}
_MODULES = {"torchao": "torchao.optim", "bitsandbytes": "bitsandbytes.optim"}
STATE_BYTES = 1  # bytes per state value (the block scales add 4 bytes per 256 values: under 2%)
# Loggers that warn while torchao is imported: of each optional kernel library it cannot load (built for
# another Python or CUDA; the 8-bit optimizers use none), and of the enums it registers with torch's pytree.
_IMPORT_NOISE = ("torchao", "torch.utils._pytree")


class _ImportNoise(logging.Filter):
    """Drops the two warnings importing torchao prints where its optional kernels do not load here; a user's
    job that imports transformers imports torchao too. Every other record of those loggers passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Failed to load ") or "is an Enum subclass and is now natively" in message)


def quiet_import_noise() -> None:
    """Filter torchao's import noise (`_ImportNoise`) for the rest of the process: in the jobs `autotune run`
    starts, where the user's own imports bring torchao in."""
    for name in _IMPORT_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ImportNoise) for f in logger.filters):
            logger.addFilter(_ImportNoise())


def backend(device_type: str) -> tuple[str, Any] | None:
    """(package, its optim module) of the first importable 8-bit implementation for `device_type`, or None."""
    for package in PACKAGES:
        if package == "bitsandbytes" and device_type != "cuda":
            continue  # its 8-bit optimizers run CUDA kernels
        try:
            with _quiet_import():
                return package, importlib.import_module(_MODULES[package])
        except ImportError:
            continue
    return None


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """Only errors from `_IMPORT_NOISE` while the block runs; each logger's level is put back after it."""
    loggers = [logging.getLogger(name) for name in _IMPORT_NOISE]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def require(device_type: str) -> tuple[str, Any]:
    """The 8-bit implementation to use; InvalidSetting naming the packages when none is importable."""
    found = backend(device_type)
    if found is None:
        where = "" if device_type == "cuda" else " (bitsandbytes' 8-bit optimizers need CUDA)"
        raise InvalidSetting(
            "techniques: 'optimizer_8bit' needs torchao or bitsandbytes, and neither is importable" + where +
            ". Install one (pip install torchao, what the 'optim8bit' extra installs), or leave "
            "'optimizer_8bit' out of techniques")
    return found


def is_eight_bit(optimizer: Any) -> bool:
    """Whether `optimizer` is one of the 8-bit classes this knob builds."""
    return optimizer is not None and type(optimizer).__name__ in _CLASSES.values()


def supports(spec: OptimizerSpec) -> bool:
    """Whether the user's optimizer has an 8-bit form (Adam and AdamW do)."""
    return spec.cls_name in _CLASSES


def eight_bit_spec(spec: OptimizerSpec, device_type: str) -> OptimizerSpec:
    """`spec` with its class swapped for the 8-bit one: the same groups and hyperparameters."""
    name = _CLASSES.get(spec.cls_name)
    if name is None:
        raise InvalidSetting(f"techniques: 'optimizer_8bit' has an 8-bit form of Adam and AdamW only, and the "
                             f"optimizer is {spec.cls_name}; leave 'optimizer_8bit' out of techniques")
    package, module = require(device_type)
    klass = getattr(module, name)
    return OptimizerSpec(_builder(klass, eager=device_type == "cpu"), spec.groups, f"{name} ({package})")


def _builder(klass: type, *, eager: bool) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer]:
    allowed = ("lr", "betas", "eps", "weight_decay", "amsgrad")

    def build(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        groups = [{k: v for k, v in g.items() if k == "params" or k in allowed} for g in groups]
        opt = klass(groups)
        if eager:
            opt.step = _eager(opt.step)
        return opt

    return build


def _eager(step: Callable[..., Any]) -> Callable[..., Any]:
    def eager_step(*args: Any, **kwargs: Any) -> Any:
        with torch.compiler.set_stance("force_eager"):
            return step(*args, **kwargs)

    return eager_step


def sync_hyperparameters(user: torch.optim.Optimizer, eight: torch.optim.Optimizer, spec: OptimizerSpec) -> None:
    """Copy lr, betas, eps, weight decay from the user's groups (an LR scheduler writes there) into the 8-bit
    optimizer's, which `eight_bit_spec(spec)` built from the same groups (empty ones left out). torchao keeps
    `lr` as a tensor and refuses a float in its place, so a tensor is filled, not replaced."""
    for j, theirs in zip(spec.group_indices(), eight.param_groups):
        mine = user.param_groups[j]
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key not in mine or key not in theirs:
                continue
            if isinstance(theirs[key], torch.Tensor):
                theirs[key].fill_(float(mine[key]))
            else:
                theirs[key] = mine[key]
