"""The shares' weights and state as the user's model and optimizer read them: the FP32 masters for a model
state dict, the state of both shares in the user's optimizer's layout, gathered from every rank when they are
partitioned over replicated ranks, and `restore()`, which hands the weights back to the device. `Shares`
(shares.py) inherits it; its fields are set there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn

from ...devices.ceiling import host_memory
from ...devices.shards import is_shard
from ...workload.optimizers import OptimizerSpec
from .partition import Gathered, Partition
from .tensors import _master_dtype_of, local_part


class ShareState:
    """Reading and loading the weights and state of `Shares` (see there for the fields)."""

    params: list[nn.Parameter]
    spec: OptimizerSpec
    dtypes: list[torch.dtype]
    kept: set[int]
    master: dict[int, torch.Tensor]
    flat: torch.Tensor | None
    device_master: dict[int, torch.Tensor]
    host_index: list[int]
    device_index: list[int]
    foreign: list[int]
    partition: Partition | None
    gathered: Gathered
    optimizer: Any
    device_optimizer: Any

    def _restore_foreign(self, gather: bool) -> None:
        """The FP32 weights of the parameters other ranks stepped: gathered from them where the ranks agreed
        to (`gather`: TrainingStep, whose ranks close alike); in a trial, where a rank that ran out of memory
        building its optimizer restores nothing, their 16-bit weights widened (the search puts the model's own
        weights back when it ends)."""
        if gather:
            current = [i for i, p in enumerate(self.params) if id(p) in self.kept]
            assert self.partition is not None, "restore() reaches here only partitioned"
            self.partition.gather_weights(self.params, self.dtypes, current)
            return
        for i in self.foreign:
            if id(self.params[i]) in self.kept:
                continue
            self.params[i].data = self.params[i].data.to(self.dtypes[i])

    # -- the weights training uses, for the model's state dict -------------------------------------------
    def holds_weight(self, i: int) -> bool:
        """Whether position i's full-precision weight lives apart from its device parameter: a master here
        (host or device share) or on the rank that steps it. Kept FP32 parameters are their own masters."""
        if id(self.params[i]) in self.kept:
            return False
        return i in self.master or i in self.device_master or i in self.foreign

    def weight(self, i: int) -> torch.Tensor:
        """Position i's full-precision weight (see `holds_weight`), detached.

        A host master is returned as a copy with its own storage: the masters are views of one pinned buffer
        (which a safetensors save would refuse as shared memory) and an overlapped step re-points them. Under
        the partitioned state another rank's weight is gathered (`gather_weights`), a collective.
        """
        if i in self.master:
            with host_memory():
                return self.master[i].detach().clone()
        if i in self.device_master:
            return self.device_master[i].detach()
        self.gather_weights()
        assert self.gathered.weights is not None
        return self.gathered.weights[i]

    def gather_weights(self) -> None:
        """Partitioned: the other ranks' full-precision weights, once until `forget_weights` (a collective)."""
        if self.gathered.weights is None and self.partition is not None:
            self.gathered.weights = self._gather_foreign()

    def _gather_foreign(self) -> dict[int, torch.Tensor]:
        """The full-precision weights other ranks hold the masters of, as host tensors: every rank sends its
        own and receives the rest (a collective, in the same order on every rank)."""
        assert self.partition is not None
        own = {**{i: m for i, m in self.device_master.items() if m is not self.params[i]}, **self.master}
        shapes = [p.shape for p in self.params]
        dtypes = [_master_dtype_of(d) for d in self.dtypes]
        kept = [i for i, p in enumerate(self.params) if id(p) in self.kept]
        with host_memory():
            return self.partition.gather_masters(own, shapes, dtypes, skip=kept)

    def forget_weights(self) -> None:
        """Drop the other ranks' weights gathered for a state dict (host memory held only while it is built)."""
        self.gathered.weights = None

    def has_master(self, i: int) -> bool:
        """Whether this rank keeps a master of position i that the step writes back into the parameter (a
        kept FP32 parameter may have one too: the host steps it)."""
        return i in self.master or (i in self.device_master and self.device_master[i] is not self.params[i])

    @torch.no_grad()
    def load_weight(self, i: int, value: torch.Tensor) -> None:
        """Position i's full-precision weight from a checkpoint: into its master, so the next step trains from
        it unrounded (the device's 16-bit copy is loaded by torch itself). Another rank's master is loaded there."""
        value = local_part(value.detach())
        if i in self.master:
            with host_memory():
                self.master[i].copy_(value)
        elif self.has_master(i):
            self.device_master[i].copy_(value)

    # -- state, in the layout of the user's optimizer -----------------------------------------------------
    def owners(self) -> list[tuple[torch.optim.Optimizer, torch.Tensor]]:
        """(optimizer, state key) of each trainable parameter in the order of the user's groups: position
        k of the user's `state_dict()["state"]`. The key is the host master, or the parameter itself for
        the share stepped on the device."""
        out: list[tuple[Any, torch.Tensor]] = []
        for i in self.spec.order():
            if i in self.master:
                out.append((self.optimizer, self.master[i]))
            elif i in self.device_master:
                out.append((self.device_optimizer, self.device_master[i]))
            else:  # stepped by another rank: its state once gathered (`gather`)
                out.append((self.gathered, self.params[i]))
        return out

    def gather(self) -> None:
        """Partitioned: the state of the parameters other ranks step, into `self.gathered`. A collective:
        every rank must call it (`state_dict()` does). A no-op on one rank, or once restored."""
        if self.partition is None or (self.optimizer is None and self.device_optimizer is None):  # restored
            return
        states = {i: opt.state[key] for i, (opt, key) in zip(self.spec.order(), self.owners())
                  if opt is not self.gathered and opt.state.get(key)}
        self.partition.gather_state(states, self.params, self.gathered)

    def state_dict(self) -> dict[str, Any]:
        """The state of both shares, keyed as the user's optimizer keys it (partitioned: gathered from every
        rank, so every rank must call it)."""
        self.gather()
        sd = (self.optimizer or self.device_optimizer).state_dict()
        sd["state"] = {k: opt.state[key] for k, (opt, key) in enumerate(self.owners()) if opt.state.get(key)}
        return sd

    def load_user_state(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of the user's layout into the host and device shares (each cast to where it lives)."""
        state = state_dict.get("state", {})
        order = self.spec.order()
        for opt, share in ((self.optimizer, set(self.host_index)), (self.device_optimizer, set(self.device_index))):
            if opt is None:
                continue
            positions = [k for k, i in enumerate(order) if i in share]
            part = opt.state_dict()
            part["state"] = {n: state[k] for n, k in enumerate(positions) if k in state}
            if opt is self.optimizer:  # the host masters are plain tensors: a shard's state as its local part
                part["state"] = {n: {name: local_part(v) if isinstance(v, torch.Tensor) else v
                                     for name, v in entry.items()} for n, entry in part["state"].items()}
            with host_memory() if opt is self.optimizer else contextlib.nullcontext():
                opt.load_state_dict(part)

    def sync_hyperparameters(self, groups: Sequence[dict[str, Any]], skip: Collection[str]) -> None:
        """Copy lr, betas, weight decay... from the user's groups (one per spec group) into both shares."""
        for opt, share in ((self.optimizer, self.host_index), (self.device_optimizer, self.device_index)):
            if opt is None:
                continue
            for j, theirs in zip(self.spec.group_indices(share), opt.param_groups):
                for key, value in groups[j].items():
                    if key not in skip and key in theirs:
                        theirs[key] = value

    def discard_state(self) -> None:
        """Drop the optimizer state of both shares (a trial's: nobody reads it after), freeing the device share's
        moments before `restore` brings the FP32 weights back."""
        for opt in (self.optimizer, self.device_optimizer):
            if opt is not None:
                opt.state.clear()

    @torch.no_grad()
    def restore(self, *, gather: bool) -> None:
        """Undo the offload: the weights back on the device in the dtype they came in, host copies released
        (the engine has stopped every copy and step first). `gather`: every rank's weights and state come back
        (`HostOptimizer.for_training`)."""
        if gather:
            self.gather()  # before the state goes: the user's optimizer gets every rank's back
        # Room first, then the weights: the gradients go before any FP32 weight comes back (and a trial drops
        # the optimizer state before this: `discard_state`), so that a large model fits back in its budget.
        for p in self.params:
            p.grad = None
        for i, master in [*self.master.items(), *self.device_master.items()]:
            p = self.params[i]
            if master is not p and not is_shard(p):  # a shard's FP32 storage was updated in place
                p.data = master.detach().to(p.device, dtype=self.dtypes[i], copy=True)
        if self.partition is not None:  # the weights other ranks held the masters of (norm weights are current)
            self._restore_foreign(gather)
        self.master = {}
        self.device_master = {}
        self.flat = None
        self.optimizer = None
        self.device_optimizer = None
