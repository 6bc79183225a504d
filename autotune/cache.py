"""Plan cache (placeholder until the cache issue lands): keys are computed, nothing is stored."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from . import batch as batches
from .plan import PLAN_FORMAT_VERSION


def open_cache(setting: Any) -> Any:
    return None


def key_parts(*, model: torch.nn.Module, batch: Any, global_batch_size: int, world_size: int, placement: Any,
              budget_bytes: int, techniques: frozenset[str], margin: float) -> dict[str, Any]:
    return {
        "model": [(type(m).__name__) for m in model.modules()]
        + [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()],
        "batch": batches.signature(batch),
        "global_batch_size": global_batch_size,
        "world_size": world_size,
        "device": [placement.name, placement.total_bytes],
        "budget_bytes": budget_bytes,
        "margin": margin,
        "techniques": sorted(techniques),
        "torch": torch.__version__,
        "format": PLAN_FORMAT_VERSION,
    }


def plan_key(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
