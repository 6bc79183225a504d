"""The plan cache's key: everything about a workload that changes which plan is right, hashed.

`key_parts` describes a workload as plain JSON (model fingerprint, batch signature, batch sizes, the nodes the
ranks spread over, device, budget, margin, techniques, optimizer, loss, runtime versions, the host where offload
may spend it, plan format); `plan_key` hashes it. The parts are stored beside each plan, so a row from a
teammate's export is checked by hashing its parts again (`check_parts` validates their shape first): a row whose
key does not match is rejected.

The model enters through a digest of its structure, not its weights' values: module classes and their
plain settings (`n_head`, `eps`, `p`...), parameter names, shapes, dtypes and `requires_grad` (frozen
weights need no gradient or optimizer state), and buffers. Training the model does not change its key.
Where in doubt the key errs toward a miss (one more tune) rather than a wrong hit (a plan for another
workload): a module attribute that changes as training goes (a step counter) changes the key too.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
from typing import Any

import torch

from ..devices import host as host_memory
from ..plan import PLAN_FORMAT_VERSION
from ..techniques import TECHNIQUES as TECHNIQUE_NAMES
from ..techniques import attention_lengths
from ..workload import batch as batches

# The key's parts, each with whether every key carries it, as `RUNTIME_FIELDS` below: `key_parts` writes an optional
# part only where it applies ("nodes" on two or more nodes), so the keys of one-node jobs stay those already cached.
PARTS: dict[str, bool] = {"format": True, "model": True, "batch": True, "global_batch_size": True, "world_size": True,
                          "nodes": False, "device": True, "budget_bytes": True, "margin": True, "techniques": True,
                          "max_micro_batch": True, "optimizer": True, "loss": True, "runtime": True, "host": True}
# The runtime part's fields, each with whether every key carries it: `runtime_versions` writes from this table and
# `check_parts` reads with it, so a field one adds is one the other accepts. An optional field is written only where
# it applies, so the keys of workloads it does not touch stay those already cached.
RUNTIME_FIELDS: dict[str, bool] = {"torch": True, "cuda": True, "alloc_conf": True, "attention_multiple": False}
_GIB = 1 << 30

# Optimizer hyperparameters that change how much state or scratch memory a step needs; the others
# (lr, betas, weight_decay) change the numbers, not the bytes, and a schedule moves them constantly.
_OPTIMIZER_MEMORY_KEYS = ("amsgrad", "foreach", "fused", "capturable", "differentiable", "nesterov")
_CONFIG_ATTRIBUTES = ("config", "cfg")  # where models conventionally keep hyperparameters (HF, nanoGPT)
_MAX_SEQUENCE = 16  # tuples longer than this are data, not settings


def key_parts(*, model: torch.nn.Module, batch: Any, global_batch_size: int, world_size: int, placement: Any,
              budget_bytes: int, techniques: frozenset[str], margin: float, optimizer: Any = None,
              loss_fn: Any = None, max_micro_batch: int | None = None,
              host_budget_bytes: int | None = None, nodes: int = 1) -> dict[str, Any]:
    """Describe a workload as JSON-ready parts of its cache key.

    Args:
        model: the model being tuned.
        batch: the example batch (its signature excludes the batch dimension).
        global_batch_size: samples per optimizer step over all ranks.
        world_size: number of ranks.
        placement: an `autotune.devices.placement.Placement` (kind, GPU name, total memory).
        budget_bytes: the memory budget in bytes.
        techniques: the allowed rungs.
        margin: the fraction of the budget kept free.
        optimizer: what `fit` got: None (AdamW), an optimizer, or a factory.
        loss_fn: what `fit` got: None (the model's own loss) or a callable.
        max_micro_batch: an explicit cap on the micro-batch, if any.
        host_budget_bytes: an explicit `host_memory_budget` in bytes, if any.
        nodes: the machines the ranks spread over (`parallel.topology`): a plan for 2 nodes x 8 GPUs pays for a
            link between nodes that 16 GPUs of one machine do not, so it serves that topology only.

    Returns:
        A dict of JSON values; `plan_key(parts)` is the key.
    """
    parts = {
        "format": PLAN_FORMAT_VERSION,
        "model": model_fingerprint(model),
        "batch": [[path, list(shape), dtype] for path, shape, dtype in batches.signature(batch)],
        "global_batch_size": int(global_batch_size),
        "world_size": int(world_size),
        "nodes": int(nodes) if nodes > 1 else None,
        "device": {"kind": placement.kind, "name": placement.name, "total_bytes": int(placement.total_bytes)},
        "budget_bytes": int(budget_bytes),
        "margin": float(margin),
        "techniques": sorted(techniques),
        "max_micro_batch": max_micro_batch,
        "optimizer": optimizer_fingerprint(optimizer),
        "loss": callable_name(loss_fn),
        "runtime": runtime_versions(placement.kind),
        "host": host_part(techniques, host_budget_bytes),
    }
    return {name: parts[name] for name, always in PARTS.items() if always or parts[name] is not None}


def host_part(techniques: frozenset[str], host_budget_bytes: int | None) -> dict[str, Any] | None:
    """The host's memory where offload may spend it: None where offload is not allowed (the host does not
    change the plan), else the machine's memory in whole GiB and an explicit host budget. A plan tuned on a
    512 GiB host may keep more on the host than a 64 GiB one holds; the default budget (what is available
    now) moves with other work, so the machine's size stands for it and `fit` checks what is free when serving."""
    if "offload" not in techniques:
        return None
    return {"total_gib": host_memory.total_bytes() // _GIB, "budget_bytes": host_budget_bytes}


def plan_key(parts: dict[str, Any]) -> str:
    """The cache key: SHA-256 of the parts as canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(canonical_json(parts).encode()).hexdigest()


def canonical_json(value: Any) -> str:
    """One spelling per value, so the same parts hash the same here and after a JSON round trip."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True)


# -- fingerprints -------------------------------------------------------------------------------------------

def model_fingerprint(model: torch.nn.Module) -> dict[str, Any]:
    """Class, parameter counts and a digest of the structure (never the weights' values)."""
    params = list(model.named_parameters())
    structure = {
        "modules": [[name, type(m).__qualname__, _settings(m)] for name, m in model.named_modules()],
        "parameters": [[name, list(p.shape), _dtype(p), p.requires_grad] for name, p in params],
        "buffers": [[name, list(b.shape), _dtype(b)] for name, b in model.named_buffers()],
        "config": _model_config(model),
    }
    # default=repr: odd settings (an enum, a dtype) still hash deterministically.
    digest = hashlib.sha256(json.dumps(structure, sort_keys=True, default=repr).encode()).hexdigest()
    return {
        "class": type(model).__qualname__,
        "parameters": sum(p.numel() for _, p in params),
        "trainable": sum(p.numel() for _, p in params if p.requires_grad),
        "digest": digest,
    }


def optimizer_fingerprint(optimizer: Any) -> dict[str, Any]:
    """The optimizer's class and the flags that change its memory (state tensors, fused/foreach scratch)."""
    if optimizer is None:
        return {"class": "AdamW", "groups": [_default_adamw_flags()]}  # fit's default: AdamW as torch builds it
    if isinstance(optimizer, torch.optim.Optimizer):
        # Distinct flag sets only: decay / no-decay groups of one optimizer need the same memory as one group.
        flags = {canonical_json(_group_flags(g)): _group_flags(g) for g in optimizer.param_groups}
        return {"class": type(optimizer).__qualname__, "groups": [flags[k] for k in sorted(flags)]}
    return {"class": "factory:" + callable_name(optimizer), "groups": []}


def callable_name(fn: Any) -> str:
    """`module.qualname` of a function or callable object; "default" for None."""
    if fn is None:
        return "default"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{name}"


def runtime_versions(kind: str) -> dict[str, Any]:
    """torch and CUDA versions, and on CUDA the allocator settings (expandable segments change peaks); the
    length attention is padded to, where it is (another shape per step, and another speed)."""
    alloc = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    values: dict[str, Any] = {
        "torch": str(torch.__version__), "cuda": torch.version.cuda, "alloc_conf": alloc if kind == "cuda" else None,
        "attention_multiple": attention_lengths.MULTIPLE if attention_lengths.wanted(kind) else None}
    return {name: values[name] for name, always in RUNTIME_FIELDS.items() if always or values[name] is not None}


@functools.cache
def _default_adamw_flags() -> dict[str, Any]:
    # Read from the signature, not a built optimizer: the first optimizer built in a process imports
    # torch's compiler stack (seconds), which would turn a millisecond cache hit into a slow one.
    defaults = {name: p.default for name, p in inspect.signature(torch.optim.AdamW).parameters.items()}
    return _group_flags(defaults)


def _group_flags(group: dict[str, Any]) -> dict[str, Any]:
    flags = {k: group[k] for k in _OPTIMIZER_MEMORY_KEYS if k in group and _is_setting(group[k])}
    if "momentum" in group:  # SGD keeps a momentum buffer only when momentum is non-zero
        flags["momentum"] = bool(group["momentum"])
    return flags


def _settings(module: torch.nn.Module) -> dict[str, Any]:
    """A module's plain public attributes (n_head, eps, p...): hyperparameters invisible in its shapes."""
    return {k: v for k, v in sorted(vars(module).items())
            if not k.startswith("_") and k != "training" and _is_setting(v)}


def _model_config(model: torch.nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for attr in _CONFIG_ATTRIBUTES:
        config = getattr(model, attr, None)
        if config is None or isinstance(config, torch.nn.Module):
            continue
        settings = {k: v for k, v in sorted(_config_values(config).items())
                    if not k.startswith("_") and _is_setting(v)}
        # Hugging Face keeps the attention kernel (eager / sdpa / flash) here; it changes memory a lot.
        if hasattr(config, "_attn_implementation"):
            settings["_attn_implementation"] = str(config._attn_implementation)
        out[attr] = settings
    return out


def _config_values(config: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return dict(vars(config)) if hasattr(config, "__dict__") else {}


def _is_setting(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return True
    if isinstance(value, (tuple, list)) and len(value) <= _MAX_SEQUENCE:
        return all(v is None or isinstance(v, (bool, int, float, str)) for v in value)
    return False


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


# -- validating parts from elsewhere --------------------------------------------------------------------

def check_parts(parts: Any) -> None:
    """Check that key parts read from a file have the shape `key_parts` writes.

    Raises:
        ValueError: naming the first field that is missing, unknown or of the wrong type or range.
    """
    if not isinstance(parts, dict):
        raise ValueError(f"parts must be an object, got {type(parts).__name__}")
    _check_fields("parts", parts, tuple(PARTS), required=tuple(name for name, always in PARTS.items() if always))
    if parts["format"] != PLAN_FORMAT_VERSION:
        raise ValueError(f"parts.format is {parts['format']!r}, this autotune reads {PLAN_FORMAT_VERSION}")
    _check_fields("parts.model", parts["model"], ("class", "parameters", "trainable", "digest"))
    _check_str("parts.model.class", parts["model"]["class"])
    _check_str("parts.model.digest", parts["model"]["digest"])
    for name in ("parameters", "trainable"):
        _check_int(f"parts.model.{name}", parts["model"][name], minimum=0)
    _check_batch(parts["batch"])
    for name in ("global_batch_size", "world_size", "budget_bytes"):
        _check_int(f"parts.{name}", parts[name], minimum=1)
    if "nodes" in parts:
        _check_int("parts.nodes", parts["nodes"], minimum=2)
        if parts["world_size"] % parts["nodes"]:
            raise ValueError(f"parts.nodes {parts['nodes']} does not divide parts.world_size {parts['world_size']}")
    if parts["max_micro_batch"] is not None:
        _check_int("parts.max_micro_batch", parts["max_micro_batch"], minimum=1)
    margin = parts["margin"]
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"parts.margin must be a fraction in [0, 1), got {margin!r}")
    _check_fields("parts.device", parts["device"], ("kind", "name", "total_bytes"))
    if parts["device"]["kind"] not in ("cuda", "cpu"):
        raise ValueError(f"parts.device.kind must be cuda or cpu, got {parts['device']['kind']!r}")
    _check_str("parts.device.name", parts["device"]["name"])
    _check_int("parts.device.total_bytes", parts["device"]["total_bytes"], minimum=0)
    techniques = parts["techniques"]
    if not isinstance(techniques, list) or not set(techniques) <= set(TECHNIQUE_NAMES):
        raise ValueError(f"parts.techniques must list some of {', '.join(TECHNIQUE_NAMES)}, got {techniques!r}")
    _check_fields("parts.optimizer", parts["optimizer"], ("class", "groups"))
    _check_str("parts.optimizer.class", parts["optimizer"]["class"])
    _check_str("parts.loss", parts["loss"])
    _check_runtime(parts["runtime"])
    if parts["host"] is not None:
        _check_fields("parts.host", parts["host"], ("total_gib", "budget_bytes"))
        _check_int("parts.host.total_gib", parts["host"]["total_gib"], minimum=0)
        if parts["host"]["budget_bytes"] is not None:
            _check_int("parts.host.budget_bytes", parts["host"]["budget_bytes"], minimum=1)


def _check_runtime(runtime: Any) -> None:
    required = tuple(name for name, always in RUNTIME_FIELDS.items() if always)
    _check_fields("parts.runtime", runtime, tuple(RUNTIME_FIELDS), required=required)
    multiple = runtime.get("attention_multiple")
    if multiple is not None:
        _check_int("parts.runtime.attention_multiple", multiple, minimum=1)


def _check_batch(batch: Any) -> None:
    if not isinstance(batch, list):
        raise ValueError(f"parts.batch must be a list, got {type(batch).__name__}")
    for entry in batch:
        ok = (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and isinstance(entry[2], str)
              and isinstance(entry[1], list)
              and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[1]))
        if not ok:
            raise ValueError(f"parts.batch entries must be [path, [dims...], dtype], got {entry!r}")


def _check_fields(name: str, value: Any, fields: tuple[str, ...], *, required: tuple[str, ...] | None = None) -> None:
    """`value` is an object whose fields are among `fields`, with every one of `required` (default: all)."""
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, got {type(value).__name__}")
    needed = fields if required is None else required
    unknown, missing = sorted(set(value) - set(fields)), sorted(set(needed) - set(value))
    if unknown:
        raise ValueError(f"unknown field(s) in {name}: {', '.join(unknown)}")
    if missing:
        raise ValueError(f"missing field(s) in {name}: {', '.join(missing)}")


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_str(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
