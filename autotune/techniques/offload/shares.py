"""The parameters under optimizer offload, seen from both sides, as both engines share them: the 16-bit device
weights, the host share's FP32 masters (views of one flat buffer where they have one dtype) with the host
optimizer over them, the device share's FP32 masters with a device optimizer, and this rank's part of a
partition over replicated ranks. The engines (`host_engine.py`, `streamed_engine.py`) only step the host share;
its state dict, weights and `restore()`, as the user's optimizer and model read them, are in `share_state.py`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, cast

import torch
from torch import nn

from ...devices.ceiling import host_memory
from ...devices.shards import is_shard
from ...workload.optimizers import OptimizerSpec
from . import partition as offload_partition
from .partition import Gathered, Partition
from .share_state import ShareState
from .tensors import device_dtype, host_masters, host_share, master_dtype


class Shares(ShareState):
    """The host and device shares of one set of parameters: their masters, their two optimizers, which rank
    steps which, and the device share's step.

    Every share steps as torch's optimizer would: a parameter whose gradient is None after backward (a head
    or expert this batch did not use) is not stepped, so it gets no weight decay, no moment update and no
    step count, and keeps no state before its first gradient.

    `fraction` < 1 is partial offload (`plan.offload_fraction`): only that share of the parameters (the
    last in model order, `host_share`) has its master and state on the host; the rest keep FP32 weights
    on the device and are stepped there by a device optimizer of the same kind and hyperparameters.

    On replicated ranks each rank steps only its runs of both shares (`partition`, partition.py):
    `host_index` and `device_index` are this rank's, `foreign` the other ranks', whose weights arrive after
    each step; `state_dict()` and `restore()` gather what the others hold (into `gathered`).

    Parameters in `keep_fp32` (normalization layers': see `norm_parameters`) keep FP32 device weights:
    BatchNorm needs its weight in the dtype of its FP32 running statistics (cuDNN and the CPU kernel both
    refuse a 16-bit weight beside them), and norm weights are a negligible share of the memory.

    FSDP2-sharded parameters (DTensors) keep their FP32 shards too: FSDP casts them to 16 bits itself when
    it all-gathers (`MixedPrecisionPolicy`) and assigns FP32 reduced gradients to them, which a 16-bit
    shard refuses. Their masters copy this rank's shard only (`local_part`), so the host holds 1/world of
    the FP32 weights and optimizer state, and the device saves the optimizer state.
    """

    def __init__(self, params: Sequence[nn.Parameter], spec: OptimizerSpec, dtype: torch.dtype,
                 state: dict[str, Any] | None = None, keep_fp32: Collection[nn.Parameter] = (), *,
                 fraction: float = 1.0) -> None:
        self.params = list(params)
        self.spec = spec
        self.dtypes = [p.dtype for p in self.params]  # each comes back in its own dtype (restore)
        self.kept = {id(p) for p in keep_fp32} | {id(p) for p in self.params if is_shard(p)}
        self._place(fraction, dtype)
        self.gathered = Gathered()  # the other ranks' state and weights, when gathered
        self._build_host()
        self._build_device()
        if state is not None:
            self.load_user_state(state)
        with torch.no_grad():
            for p in self.params:
                if id(p) not in self.kept:
                    # the device copy shrinks to 16 bits; its FP32 storage is freed
                    p.data = p.data.to(device_dtype(p, dtype))

    def _place(self, fraction: float, dtype: torch.dtype) -> None:
        """Which positions go to the host and which stay on the device, and of those, which this rank steps."""
        numels = [p.numel() for p in self.params]
        host_all = host_share(numels, fraction)
        device_all = [i for i in range(len(self.params)) if i not in set(host_all)]
        self.fraction = sum(numels[i] for i in host_all) / max(1, sum(numels))
        # Replicated ranks each step their runs of both shares and send the weights (partition.py).
        precision = "fp16" if dtype == torch.float16 else "bf16"
        self.partition = (Partition([host_all, device_all], numels)
                          if offload_partition.ranks(precision, self.sharded) > 1 else None)
        mine = self.partition.mine if self.partition is not None else list
        self.host_index, self.device_index = mine(host_all), mine(device_all)
        stepped_here = set(self.host_index) | set(self.device_index)
        self.foreign = sorted(set(range(len(self.params))) - stepped_here)  # other ranks step these

    def _build_host(self) -> None:
        """The host share's FP32 masters (views of one flat buffer where they can be) and its optimizer."""
        host = set(self.host_index)
        with host_memory():
            self.master, self.flat = host_masters(self.params, self.host_index)
            slots = [self.master.get(i, p) for i, p in enumerate(self.params)]
            # None with no host share: the optimizer state sharded over replicated ranks keeps every master
            # on the device, partitioned over the ranks (ZeRO-1 with 16-bit weights: partition.py)
            self.optimizer = self.spec.build(slots, host=True, only=host) if host else None

    def _build_device(self) -> None:
        """The device share: FP32 masters on the device beside the same 16-bit weights (norm weights, FP32
        already, are their own masters), so forward computes in the same dtypes as under full offload."""
        self.device_master = {i: self.params[i] if id(self.params[i]) in self.kept
                              else self.params[i].detach().to(master_dtype(self.params[i]), copy=True)
                              for i in self.device_index}
        slots = [self.device_master.get(i, p) for i, p in enumerate(self.params)]
        self.device_optimizer = self.spec.build(slots, only=self.device_index) if self.device_index else None

    @property
    def sharded(self) -> bool:
        """Whether the parameters are FSDP2 shards (each rank's masters are its shard's parts)."""
        return any(is_shard(p) for p in self.params)

    @property
    def masters(self) -> list[torch.Tensor]:
        """The FP32 host masters, in the order of `host_index` (every parameter's, under full offload)."""
        return [self.master[i] for i in self.host_index]

    # -- the device share's step ------------------------------------------------------------------------
    def device_grads(self) -> list[torch.Tensor]:
        """FP32 gradients of the device share, on its masters (a temporary copy of each 16-bit gradient); a
        parameter that got none keeps none, and the device optimizer skips it."""
        grads = []
        for i, master in self.device_master.items():
            p = self.params[i]
            if p.grad is None:
                continue
            if master is not p:
                master.grad = p.grad.to(master.dtype)
            grads.append(cast(torch.Tensor, master.grad))
        return grads

    def step_device(self) -> None:
        """Step the device share (queued on the device) and copy each stepped master into its weight."""
        if self.device_optimizer is None:
            return
        self.device_optimizer.step()
        for i, master in self.device_master.items():
            if master is not self.params[i] and master.grad is not None:  # stepped: its new weight to the device
                self.params[i].data.copy_(master)

    def drop_device_grads(self) -> None:
        """The FP32 gradient copies made for the step (`device_grads`), freed before the next forward."""
        for master in self.device_master.values():
            if master is not None and not isinstance(master, nn.Parameter):
                master.grad = None
