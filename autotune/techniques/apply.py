"""`apply_rung`: put one configuration on a model and get back what a training step needs.

A technique that is off is a null context or a no-op, so the training step has one code path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..configuration import Rung
from ..devices.placement import Placement
from ..workload import batch as batches
from ..workload.optimizers import OptimizerSpec, step_fused_on_shards
from . import attention_lengths, checkpointing, fp8, optimizer_8bit
from . import compile as compiling
from .blocks import BlockGroup
from .ladder import block_count
from .offload import activations as saved_activations
from .offload import build_engine, norm_parameters, offload_of
from .precision import autocast_factory, make_scaler


@dataclass(kw_only=True)
class AppliedRung:
    """A rung in force on a model: what one micro-step and one optimizer step need."""

    rung: Rung
    model: nn.Module
    optimizer: Any  # torch.optim.Optimizer, or HostOptimizer under optimizer offload
    autocast: Callable[[], AbstractContextManager[object]]
    scaler: torch.amp.GradScaler | None
    _undo: list[Callable[[], None]]
    host_buffer_seconds: float = 0.0  # of `apply_rung`'s time, what building the host optimizer's buffers took

    def inputs(self, micro_batch: Any) -> Any:
        """The micro-batch as the model should get it: `Shared` tensors unwrapped; under compile, with a
        dynamic batch dimension (on the per-sample tensors only). Its token length is counted, for the
        attention padding of batches whose length varies (`attention_lengths.observe`)."""
        attention_lengths.observe(micro_batch)
        if self.rung.compile and not compiling.runs_static(batches.batch_size(micro_batch)):
            compiling.mark_batch_dynamic(micro_batch)  # (a mark would make a static graph's dimension symbolic)
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
               offload_fraction: float = 1.0, overlap: bool | None = None, sharding: str = "none",
               longest: int | None = None) -> AppliedRung:
    """Put `rung` on `model`; the optimizer is `optimizer` if given, else a fresh one from `spec`.

    Under optimizer offload the returned optimizer is a `HostOptimizer` (`build_engine`) built from `spec` (with
    `optimizer`'s state, when given, moved into it), holding `offload_fraction` of the parameters on the host,
    stepping them during the last backward unless `overlap` is False (`Plan.offload_overlap`).
    `sharding` is the plan's: "optimizer_state" partitions the optimizer state over the replicated ranks, which
    the same engine runs with nothing on the host (techniques/offload/partition.py); its other values are
    applied before this (FSDP2 shards the model itself) and change nothing here. `longest`: the token length the
    plan's peak was measured at, past which attention is never padded (`attention_lengths`).
    """
    partitioned = sharding == "optimizer_state"
    if partitioned and (rung.offload != "none" or rung.optimizer_8bit):
        raise ValueError(f"sharding 'optimizer_state' partitions the FP32 optimizer state on the device; {rung.name} "
                         "offloads or quantizes it: use sharding='none'")
    undo: list[Callable[[], None]] = []
    host_seconds = 0.0
    try:
        scaler = make_scaler(rung.precision, placement)
        count = block_count(rung, blocks)  # refuses checkpointing on a model without repeated blocks
        undo.append(attention_lengths.install(placement.torch_device.type, longest))
        if rung.fp8:  # before compile and checkpointing wrap the blocks that hold the layers
            undo.append(fp8.install(model))
        if rung.checkpointing != "none" and blocks is not None and not blocks.library:
            # (where the model's library checkpoints already, its blocks are recomputed once, by it)
            undo.append(checkpointing.install(blocks, count, offload_activations=rung.offload == "activations",
                                              placement=placement,
                                              inner=compiling.forward if rung.compile else None,
                                              policy=rung.recompute_policy))
        if rung.offload == "saved_activations" and blocks is not None:
            # the blocks not recomputed send what autograd saves in them to the host, behind compute
            recomputed = blocks.calls(count)
            streamed = [b for b in blocks.modules() if b not in recomputed]
            undo.append(saved_activations.install(streamed, placement.torch_device)[1])
        if rung.compile:
            undo.append(compiling.install(model, blocks, count))
        trainable = [p for p in model.parameters() if p.requires_grad]
        if rung.offload == "optimizer" or partitioned:
            state = optimizer.state_dict() if optimizer is not None and optimizer.state else None
            # fp32 (a float64 model's): the device weights keep their dtype, only the optimizer moves
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(rung.precision, torch.float32)
            held = [trainable[i] for i in spec.held()]  # no master or state for a parameter no group holds
            started = time.perf_counter()
            opt: Any = build_engine(held, spec.over_held(), dtype, scaler, state, keep_fp32=norm_parameters(model),
                                    fraction=0.0 if partitioned else offload_fraction, overlap=overlap)
            host_seconds = time.perf_counter() - started  # masters, moments, pinned buffers: a trial's phase
            undo.append(opt.restore)
        elif rung.optimizer_8bit:  # a given 8-bit optimizer is kept (recovery); the user's FP32 one is not
            opt = (optimizer if optimizer_8bit.is_eight_bit(optimizer)
                   else optimizer_8bit.eight_bit_spec(spec, placement.torch_device.type).build(trainable))
        else:
            opt = optimizer if optimizer is not None else spec.build(trainable)
            step_fused_on_shards(opt)  # the user's own, under plan.apply (`spec.build` fused its own)
        return AppliedRung(rung=rung, model=model, optimizer=opt, scaler=scaler,
                           autocast=autocast_factory(rung.precision, placement), _undo=undo,
                           host_buffer_seconds=host_seconds)
    except BaseException:
        for fn in reversed(undo):
            fn()
        raise
