"""The knobs, and `apply_rung`: put one configuration on a model and get back what a training step needs.

Knobs, each independent of the others (a lattice, not a line):
    precision       bf16 autocast (weights stay FP32), fp16 with a GradScaler, or fp32
    checkpointing   how many of the N repeated blocks are recomputed in backward, 0..N
    offload         none; activations (block inputs parked in pinned host memory, with checkpointing);
                    optimizer (FP32 masters and optimizer state on the host, with or without checkpointing)
    compile         torch.compile on the whole model, or per block (a recomputed block inside its checkpoint)
    chunked_loss    a Hugging Face causal LM's head and loss a chunk of tokens at a time (no knob to search:
                    on whenever allowed and the model takes it; `workload/chunked_loss.py`)

`anchors` are the configurations the search measures first (every offload with none and with all blocks
recomputed); the search then places intermediate block counts and compile from what they measured.
`ladder` is the line recovery climbs in training: each rung keeps every technique of the one below.

A technique that is off is a null context or a no-op, so the training step has one code path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
import dataclasses
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..devices.placement import Placement
from ..sizes import format_bytes
from ..errors import InvalidSetting
from ..workload import batch as batches
from ..workload.optimizers import OptimizerSpec
from ..configuration import Rung
from . import checkpointing, optimizer_8bit
from . import compile as compiling
from .blocks import BlockGroup, find_blocks, profile_blocks
from .offload import HostOptimizer, device_dtype, local_part, norm_parameters, offload_of
from .precision import autocast_factory, choose_precision, make_scaler

FLOAT64_KEPT = "float64 model: kept in float64 (bf16 autocast only where techniques names 'bf16')"
TECHNIQUES = ("bf16", "checkpointing", "offload", "compile", "optimizer_8bit", "chunked_loss")
DEFAULT_TECHNIQUES = ("bf16", "checkpointing", "offload", "compile", "chunked_loss")  # 8-bit state changes the numerics: opt-in

__all__ = ["TECHNIQUES", "DEFAULT_TECHNIQUES", "AppliedRung", "apply_rung", "anchors", "block_count",
           "drop_rungs_over", "dtype_conflict", "eight_bit_anchors", "is_float64", "keep_dtype", "ladder",
           "resident_floor", "parse_techniques", "serve_dtypes", "find_blocks", "profile_blocks", "BlockGroup"]


def parse_techniques(techniques: Iterable[str] | str | None) -> frozenset[str]:
    """The allowed techniques; None means the default ones (all but the opt-in 'optimizer_8bit')."""
    if techniques is None:
        return frozenset(DEFAULT_TECHNIQUES)
    if isinstance(techniques, str):
        techniques = [t.strip() for t in techniques.split(",") if t.strip()]
    chosen = frozenset(techniques)
    unknown = sorted(chosen - set(TECHNIQUES))
    if unknown:
        raise InvalidSetting(f"techniques: unknown {', '.join(map(repr, unknown))}; allowed are "
                             f"{', '.join(TECHNIQUES)} (e.g. techniques=('bf16', 'checkpointing'))")
    return chosen


def keep_dtype(allowed: frozenset[str], model: nn.Module, given: Iterable[str] | str | None) -> frozenset[str]:
    """The techniques `model` is tuned with: a float64 model keeps float64, so "bf16" is dropped unless `given`
    (the techniques the user named: fit's `techniques`, else $AUTOTUNE_TECHNIQUES) names it. The default set,
    which holds "bf16" for the usual float32 model, does not count as asking for it. A float32 model asks
    for float32 the same way: by a `techniques` without "bf16"."""
    if "bf16" not in allowed or not is_float64(model) or (given is not None and "bf16" in parse_techniques(given)):
        return allowed
    return allowed - {"bf16"}


def is_float64(model: nn.Module) -> bool:
    """Whether `model` trains float64 weights: a model holding any chose float64 for them."""
    return any(p.requires_grad and p.dtype == torch.float64 for p in model.parameters())


def ladder(allowed: frozenset[str], placement: Placement, blocks: BlockGroup | None, *,
           compile: bool = False, float64: bool = False) -> tuple[list[Rung], list[str]]:
    """The line recovery climbs, cheapest first, and a note for each rung left out and why: no
    checkpointing, half the blocks, all of them, then activation offload, then optimizer offload.

    `float64`: the model trains float64 weights (`is_float64`), which keep their dtype on the device under
    optimizer offload, so an fp32 ladder keeps that rung (its state on the host) where a float32 one cannot."""
    precision, _ = choose_precision("bf16" in allowed, placement)
    notes: list[str] = []
    n = len(blocks.blocks) if blocks is not None else 0
    counts = [0]
    if blocks is not None and blocks.library:  # said whether checkpointing is allowed or not: it is on
        notes.append(f"{blocks.library}; autotune recomputes no block on top of it")
    elif "checkpointing" in allowed:
        if blocks is None:
            notes.append("checkpointing skipped: no repeated blocks (two or more same-class modules with "
                         "children of their own, in a ModuleList, a Sequential or as attributes) found in the model")
        else:
            counts += [(n + 1) // 2, n] if n >= 4 else [n]
    rungs = [_rung(precision, k, n, "none", compile) for k in counts]
    top = counts[-1]
    if "offload" in allowed:
        if top:
            rungs.append(_rung(precision, top, n, "activations", compile))
        if precision != "fp32" or float64:
            rungs.append(_rung(precision, top, n, "optimizer", compile))
        else:
            notes.append("optimizer offload skipped: it keeps 16-bit weights on the device and fp32 was asked for")
    return rungs, notes


def anchors(allowed: frozenset[str], placement: Placement, blocks: BlockGroup | None, *,
            float64: bool = False) -> tuple[list[Rung], list[str]]:
    """The eager configurations the search measures first, in the order it tries them (`float64`: see `ladder`).

    Every offload is tried with no block and with every block recomputed: these corners give the bytes
    per sample with and without recompute and the resident floor with and without optimizer offload,
    from which the search predicts the rest of the lattice (intermediate block counts, compile).
    """
    rungs, notes = ladder(allowed, placement, blocks, float64=float64)
    n = len(blocks.blocks) if blocks is not None else 0
    plain = [r for r in rungs if r.offload == "none" and r.checkpointed_blocks in (0, n)]
    optimizer = [r for r in rungs if r.offload == "optimizer"]
    bare = [dataclasses.replace(r, checkpointing="none", checkpointed_blocks=0) for r in optimizer if n][:1]
    # Optimizer offload without recompute (its floor, none of the recompute) before activation offload.
    order = plain + bare + [r for r in rungs if r.offload == "activations"] + optimizer
    return list(dict.fromkeys(order)), notes


def block_count(rung: Rung, blocks: BlockGroup | None) -> int:
    """How many blocks `rung` recomputes: its count, or its label's default when it has none."""
    n = len(blocks.blocks) if blocks is not None else 0
    if rung.checkpointed_blocks is not None:
        return min(rung.checkpointed_blocks, n)
    return {"none": 0, "selective": (n + 1) // 2, "full": n}[rung.checkpointing]


def _rung(precision: str, k: int, n: int, offload: str, compile: bool) -> Rung:
    label = "none" if k == 0 else "full" if k >= n else "selective"
    return Rung(precision=precision, checkpointing=label, checkpointed_blocks=k, offload=offload, compile=compile)


def resident_floor(rung: Rung, model: nn.Module, state_tensors: int) -> int:
    """Bytes the rung keeps on the device before any activation exists: weights, gradients and optimizer
    state on the lower rungs; 16-bit weights and gradients under optimizer offload. A lower bound.

    An FSDP2 rank holds only its shard of each parameter (and of its gradient and state); under optimizer
    offload a shard keeps its FP32 weight and gradient (see `HostOptimizer`).
    """
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    if rung.offload == "optimizer":  # each weight and gradient at its device dtype: 2 bytes from FP32
        def size(p: nn.Parameter) -> int:
            if isinstance(p, DTensor):  # an FSDP2 shard keeps its dtype (see HostOptimizer)
                return _held(p) * p.element_size()
            return _held(p) * torch.empty((), dtype=device_dtype(p, torch.bfloat16)).element_size()
        return sum(size(p) for p in params) + sum(size(p) for p in trainable)
    weights = sum(_held(p) * p.element_size() for p in params)
    grads = sum(_held(p) * p.element_size() for p in trainable)
    if rung.optimizer_8bit:
        return weights + grads + state_tensors * optimizer_8bit.STATE_BYTES * sum(_held(p) for p in trainable)
    return weights + (1 + state_tensors) * grads


def _held(p: torch.Tensor) -> int:
    """Elements of `p` this rank holds: its local shard under FSDP2, else all of them."""
    return local_part(p.detach()).numel()


def eight_bit_anchors(rungs: list[Rung], allowed: frozenset[str], spec: OptimizerSpec,
                      device_type: str) -> tuple[list[Rung], list[str]]:
    """When 'optimizer_8bit' is allowed, the anchors plus an 8-bit twin of each anchor stepped on the device,
    tried last: 8-bit state is what the user accepts when nothing lighter fits, not a first choice.
    The missing package is an error here, before any trial (see `optimizer_8bit.require`)."""
    if "optimizer_8bit" not in allowed:
        return rungs, []
    if not optimizer_8bit.supports(spec):
        return rungs, [f"optimizer_8bit skipped: only Adam and AdamW have an 8-bit form, not {spec.cls_name}"]
    optimizer_8bit.require(device_type)
    twins = [dataclasses.replace(r, optimizer_8bit=True) for r in rungs
             if r.offload != "optimizer" and not r.compile]
    return rungs + twins, []


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
        return ("fp16 without optimizer offload skipped: fp16 loss scaling cannot unscale the float16 gradients of a float16 "
                "model (torch's GradScaler refuses them); optimizer offload keeps FP32 copies on the host and can")
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


def drop_rungs_over(rungs: list[Rung], floors: list[int], limit_bytes: int) -> tuple[list[Rung], list[str]]:
    """Leave out the rungs whose resident floor alone is over the limit: no micro-batch can fit there, and
    a trial would only run out of memory (GPT-2 XL's FP32 weights, gradients and AdamW state are 24 GB,
    over a 16 GiB card). The top rung always stays, so a plan that cannot exist fails with its trial."""
    over = [i for i, floor in enumerate(floors) if floor > limit_bytes and i < len(rungs) - 1]
    if not over:
        return list(rungs), []
    note = (f"{', '.join(rungs[i].name for i in over)} skipped: weights, gradients and optimizer state alone "
            f"need {format_bytes(min(floors[i] for i in over))} or more, over the {format_bytes(limit_bytes)} limit")
    return [r for i, r in enumerate(rungs) if i not in over], [note]


@dataclass(kw_only=True)
class AppliedRung:
    """A rung in force on a model: what one micro-step and one optimizer step need."""

    rung: Rung
    model: nn.Module
    optimizer: Any  # torch.optim.Optimizer, or HostOptimizer under optimizer offload
    autocast: Callable[[], ContextManager[object]]
    scaler: torch.amp.GradScaler | None
    _undo: list[Callable[[], None]]

    def inputs(self, micro_batch: Any) -> Any:
        """The micro-batch as the model should get it: `Shared` tensors unwrapped; under compile, with a
        dynamic batch dimension (on the per-sample tensors only)."""
        if self.rung.compile:
            compiling.mark_batch_dynamic(micro_batch)
        return batches.unwrap(micro_batch)

    def backward(self, loss: torch.Tensor, *, last: bool = False, defer: bool = False) -> None:
        """Backward of one micro-batch. `last`: the optimizer steps right after it, so under optimizer
        offload the host starts its share during this backward (`HostOptimizer.arm`; `defer` when the
        gradients may still change before the step: clipping, a callback, a correction)."""
        if last:
            offload_of(self.optimizer).arm(defer)
        # Scale under optimizer offload too: HostOptimizer.step unscales the host gradients itself.
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def optimizer_step(self) -> None:
        if self.scaler is not None and not self._host:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def zero_grad(self) -> None:
        # Keep gradient buffers allocated: under accumulation they are live while the next micro-batch
        # runs forward, and a trial must see that peak.
        self.optimizer.zero_grad(set_to_none=False)

    @property
    def _host(self) -> bool:
        return offload_of(self.optimizer).engaged

    def remove(self) -> None:
        """Undo everything `apply_rung` did, last first."""
        while self._undo:
            self._undo.pop()()


def apply_rung(model: nn.Module, rung: Rung, spec: OptimizerSpec, placement: Placement,
               blocks: BlockGroup | None, *, optimizer: torch.optim.Optimizer | None = None,
               offload_fraction: float = 1.0, overlap: bool | None = None) -> AppliedRung:
    """Put `rung` on `model`; the optimizer is `optimizer` if given, else a fresh one from `spec`.

    Under optimizer offload the returned optimizer is a `HostOptimizer` built from `spec` (with
    `optimizer`'s state, when given, moved into it), holding `offload_fraction` of the parameters on the host,
    stepping them during the last backward unless `overlap` is False (`Plan.offload_overlap`).
    """
    undo: list[Callable[[], None]] = []
    try:
        scaler = make_scaler(rung.precision, placement)
        count = block_count(rung, blocks)
        if rung.checkpointing != "none" and not (blocks is not None and blocks.library):
            # (where the model's library checkpoints already, its blocks are recomputed once, by it)
            if blocks is None:
                raise InvalidSetting("checkpointing needs repeated blocks and none were found in the model")
            undo.append(checkpointing.install(blocks, count, offload_activations=rung.offload == "activations",
                                              placement=placement,
                                              inner=compiling.forward if rung.compile else None))
        if rung.compile:
            undo.append(compiling.install(model, blocks, count))
        trainable = [p for p in model.parameters() if p.requires_grad]
        if rung.offload == "optimizer":
            state = optimizer.state_dict() if optimizer is not None and optimizer.state else None
            # fp32 (a float64 model's): the device weights keep their dtype, only the optimizer moves
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(rung.precision, torch.float32)
            held = [trainable[i] for i in spec.held()]  # no master or state for a parameter no group holds
            opt: Any = HostOptimizer(held, spec.over_held(), dtype, scaler, state, keep_fp32=norm_parameters(model),
                                     fraction=offload_fraction, overlap=overlap)
            undo.append(opt.restore)
        elif rung.optimizer_8bit:  # a given 8-bit optimizer is kept (recovery); the user's FP32 one is not
            opt = (optimizer if optimizer_8bit.is_eight_bit(optimizer)
                   else optimizer_8bit.eight_bit_spec(spec, placement.torch_device.type).build(trainable))
        else:
            opt = optimizer if optimizer is not None else spec.build(trainable)
        return AppliedRung(rung=rung, model=model, optimizer=opt, scaler=scaler,
                           autocast=autocast_factory(rung.precision, placement), _undo=undo)
    except BaseException:
        for fn in reversed(undo):
            fn()
        raise
