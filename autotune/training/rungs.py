"""The rung in force on a trained model, and the user's optimizer and model kept consistent with it.

`RungInForce` puts a rung on the model (`apply_rung`), takes it off again, and switches to another when
recovery climbs. The optimizer that carries its state across rungs is the user's (or the one the first rung
built); under optimizer offload the links keep the user's optimizer and model truthful (`OffloadLink`,
`ModelLink`), under an 8-bit plan `EightBitLink` does. Everything about the offload goes through one
interface (`offload_of`), whichever engine steps it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ..configuration import Rung
from ..devices.placement import Placement
from ..techniques import AppliedRung, apply_rung, optimizer_8bit
from ..techniques.offload import OptimizerOffload, offload_of
from ..workload.optimizers import OptimizerSpec
from .eight_bit_link import EightBitLink
from .model_link import ModelLink
from .offload_link import OffloadLink

log = logging.getLogger(__name__)


class RungInForce:
    """The `AppliedRung` a `TrainingStep` trains with (`applied`), its offload (`offload`), and the links."""

    def __init__(self, model: nn.Module, spec: OptimizerSpec, placement: Placement, blocks: Any,
                 optimizer: Any, longest: int | None = None) -> None:
        self.model = model
        self.longest = longest  # the plan's max_length: attention is padded no further (`apply_rung`)
        self.spec = spec
        self.placement = placement
        self.blocks = blocks
        # The device optimizer whose state carries across rungs: the user's, or the one the first rung
        # builds when none was given. None only when a rung built an offload engine from scratch.
        self.device_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        self.eight_bit: Any = None  # the 8-bit optimizer of an 8-bit plan (techniques.optimizer_8bit)
        self.applied: AppliedRung | None = None
        self.offload: OptimizerOffload = offload_of(None)
        self.stepped: set[int] = set()  # positions an aborted attempt stepped for good (`abort`)
        self._links: list[Any] = []  # closed last first
        self._offload_link: OffloadLink | None = None
        # the offload's host share, its overlap and the plan's sharding in force
        self._setting: tuple[float, bool | None, str] = (1.0, None, "none")

    def _in_force(self) -> AppliedRung:
        """`applied`, which every method but `apply` needs there."""
        assert self.applied is not None, "no rung applied yet"
        return self.applied

    def apply(self, rung: Rung, *, fraction: float = 1.0, overlap: bool | None = None,
              sharding: str = "none") -> None:
        """Put `rung` on the model, with the optimizer state carried over (`sharding`: the plan's)."""
        self._setting = (fraction, overlap, sharding)
        given = self.eight_bit if rung.optimizer_8bit and self.eight_bit is not None else self.device_optimizer
        applied = apply_rung(self.model, rung, self.spec, self.placement, self.blocks, optimizer=given,
                             offload_fraction=fraction, overlap=overlap, sharding=sharding, longest=self.longest)
        self.applied = applied
        self.offload = offload_of(applied.optimizer)
        if rung.optimizer_8bit:
            self.eight_bit = applied.optimizer  # its 8-bit state carries across rungs (recovery)
            if self.device_optimizer is not None and self.device_optimizer is not applied.optimizer:
                self._links.append(EightBitLink(self.device_optimizer, applied.optimizer))
        elif self.offload.engaged:
            self.offload.for_training()  # partitioned over ranks: close() gathers weights and state
            self._links.append(ModelLink(self.model, applied.optimizer.shares))
            if self.device_optimizer is not None:
                self._offload_link = OffloadLink(self.device_optimizer, applied.optimizer.shares)
        elif self.device_optimizer is None:
            self.device_optimizer = applied.optimizer  # built from the spec: keep its state across rungs

    def remove(self, drop_gradients: Any) -> None:
        """Take the rung off: the links closed, the weights back on the device, the user's optimizer given its state."""
        links, self._links = self._links, []
        offload_link, self._offload_link = self._offload_link, None
        for link in reversed(links):
            link.close()  # the model's link before the weights come back: the parameters are the truth again
        self._in_force().remove()  # under optimizer offload: FP32 weights back on the device
        drop_gradients()
        if offload_link is not None:
            offload_link.close()

    def switch(self, rung: Rung, fraction: float, sharding: str, drop_gradients: Any) -> None:
        """Move to `rung` (recovery), the loss scale and the updates an aborted attempt made kept."""
        scaler = self._in_force().scaler
        scaler_state = scaler.state_dict() if scaler is not None else None
        old, (old_fraction, old_overlap, old_sharding) = self._in_force().rung, self._setting
        stepped, self.stepped = self.stepped, set()
        self.remove(drop_gradients)
        try:
            self.apply(rung, fraction=fraction, sharding=sharding)
        except BaseException:
            # never leave the step holding a rung already removed
            self.apply(old, fraction=old_fraction, overlap=old_overlap, sharding=old_sharding)
            raise
        if stepped and self.offload.keep_stepped(stepped):
            # Rare: an OOM in the last backward at micro-batch 1 after the host had stepped some chunks.
            log.warning("autotune: %d parameter tensors were updated before the out-of-memory error and keep "
                        "that update on %s", len(stepped), rung.name)
        new_scaler = self._in_force().scaler
        if scaler_state and new_scaler is not None:
            new_scaler.load_state_dict(scaler_state)  # the loss scale carries over

    def abort(self) -> None:
        """The attempt failed and the batch is re-run: what the offload stepped already stays stepped."""
        self.stepped = self.offload.abort()

    def before_attempt(self) -> None:
        """The user's hyperparameters (an LR scheduler's) into the optimizer actually stepped."""
        if self._offload_link is not None:
            self._offload_link.sync_hyperparameters()  # before backward: overlapped offload steps during the last one
        elif self._in_force().rung.optimizer_8bit and self.device_optimizer is not None:
            optimizer_8bit.sync_hyperparameters(self.device_optimizer, self._in_force().optimizer, self.spec)

    def step(self) -> None:
        """The optimizer step, with the user's optimizer showing the state it created."""
        if self._offload_link is not None:
            self._offload_link.sync_hyperparameters()
        try:
            self._in_force().optimizer_step()
        finally:
            self.stepped = set()  # the engine let go of them too
        if self._offload_link is not None:
            self._offload_link.mirror()  # the first step creates the host state the user's optimizer shows
