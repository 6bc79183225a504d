"""The rungs recovery climbs in training, how many blocks a rung recomputes, and which rungs can train a
model's parameter dtypes. The search starts from the same rungs (`search/anchors.py`)."""

from __future__ import annotations

import torch
from torch import nn

from ..configuration import Rung
from ..devices.placement import Placement
from ..errors import InvalidSetting
from .blocks import BlockGroup
from .precision import choose_precision

FLOAT64_KEPT = "float64 model: kept in float64 (bf16 autocast only where techniques names 'bf16')"
NO_BLOCKS = ("no repeated blocks (two or more same-class modules with children of their own, in a ModuleList, a "
             "Sequential or as attributes, or one such module called at several depths)")


def is_float64(model: nn.Module) -> bool:
    """Whether `model` trains float64 weights: a model holding any chose float64 for them."""
    return any(p.requires_grad and p.dtype == torch.float64 for p in model.parameters())


def ladder(allowed: frozenset[str], placement: Placement, blocks: BlockGroup | None, *,
           compile: bool = False, float64: bool = False) -> tuple[list[Rung], list[str]]:
    """The line recovery climbs, cheapest first, and a note for each rung left out and why: no
    checkpointing, half the blocks, all of them, then activation offload, then optimizer offload.

    `float64`: the model trains float64 weights (`is_float64`), which keep their dtype on the device under
    optimizer offload, so an fp32 ladder keeps that rung (its state on the host) where a float32 one cannot."""
    precision, why = choose_precision("bf16" in allowed, placement)
    notes: list[str] = [why] if precision == "fp32" and "bf16" in allowed else []  # allowed, yet not used here
    n = len(blocks.blocks) if blocks is not None else 0
    counts = [0]
    if blocks is not None and blocks.library:  # said whether checkpointing is allowed or not: it is on
        notes.append(f"{blocks.library}; autotune recomputes no block on top of it")
    elif "checkpointing" in allowed:
        notes += blocks.refused if blocks is not None else []  # blocks whose recompute would write state twice
        if blocks is None:
            notes.append(f"checkpointing skipped: {NO_BLOCKS} found in the model")
        elif n:
            counts += [(n + 1) // 2, n] if n >= 4 else [n]
    rungs = [_rung(precision, k, n, "none", compile) for k in counts]
    top = counts[-1]
    if "offload" in allowed:
        if top:
            rungs.append(_rung(precision, top, n, "activations", compile))
        if precision != "fp32" or float64:
            rungs.append(_rung(precision, top, n, "optimizer", compile))
        else:
            notes.append("optimizer offload skipped: it keeps 16-bit weights on the device and the plan trains in fp32")
    return rungs, notes


def block_count(rung: Rung, blocks: BlockGroup | None) -> int:
    """How many blocks `rung` recomputes: its count, or its label's default when it has none.

    Raises:
        InvalidSetting: `rung` checkpoints and the model has no repeated blocks (and no library checkpointing).
    """
    n = len(blocks.blocks) if blocks is not None else 0
    if rung.checkpointing != "none" and blocks is None:
        raise InvalidSetting(f"the plan recomputes blocks ({rung.name}) but the model has {NO_BLOCKS}: there is "
                             "nothing to checkpoint. Use a plan with checkpointing='none', or one autotune.fit made "
                             "for this model (a module called at several depths, as ALBERT's shared layer, is found "
                             "by running the model, and its calls named in plan.block_paths)")
    if rung.checkpointed_blocks is not None:
        return min(rung.checkpointed_blocks, n)
    return {"none": 0, "selective": (n + 1) // 2, "full": n}[rung.checkpointing]


def _rung(precision: str, k: int, n: int, offload: str, compile: bool) -> Rung:
    label = "none" if k == 0 else "full" if k >= n else "selective"
    return Rung(precision=precision, checkpointing=label, checkpointed_blocks=k, offload=offload, compile=compile)


def dtype_conflict(rung: Rung, model: nn.Module) -> str | None:
    """Why `rung` cannot train `model`'s parameter dtypes, or None when it can.

    FP16 loss scaling unscales the gradients in place, and `GradScaler` refuses FP16 gradients (it would
    lose what the scale protected): a float16 model under the fp16 rung crashes in its first step.
    Optimizer offload serves it (the host unscales FP32 copies). Every other rung keeps each parameter's
    dtype (float64 and bf16 included: see `offload.device_dtype`).
    """
    if rung.precision != "fp16" or rung.offload == "optimizer":
        return None
    if any(p.requires_grad and p.dtype == torch.float16 for p in model.parameters()):
        return ("fp16 without optimizer offload skipped: fp16 loss scaling cannot unscale the float16 gradients "
                "of a float16 model (torch's GradScaler refuses them); optimizer offload keeps FP32 copies on the "
                "host and can")
    return None


def serve_dtypes(rungs: list[Rung], model: nn.Module) -> tuple[list[Rung], list[str]]:
    """The rungs that can train `model`'s dtypes, and a note for each kind left out (and for a float64 model
    kept in float64)."""
    kept: list[Rung] = []
    notes = [FLOAT64_KEPT] if is_float64(model) and rungs and all(r.precision == "fp32" for r in rungs) else []
    for rung in rungs:
        why = dtype_conflict(rung, model)
        if why is None:
            kept.append(rung)
        elif why not in notes:
            notes.append(why)
    return kept, notes
