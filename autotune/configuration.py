"""The knobs a plan sets: `Rung`, one point of the search lattice, and the choices each knob takes."""

from __future__ import annotations

from dataclasses import dataclass

from .validate import check_choice, check_non_negative_int

PRECISIONS = ("bf16", "fp16", "fp32")
CHECKPOINTING = ("none", "selective", "full")
OFFLOAD = ("none", "activations", "optimizer")
# "optimizer_state": replicated ranks, each keeping the FP32 masters and optimizer state of its 1/world of the
# parameters on its device (ZeRO stage 1, `Plan.partitioned_state`)
SHARDING = ("none", "fsdp2", "optimizer_state")


def none_on_the_host(world: int | None = None) -> str:
    """How a trial names optimizer offload with nothing on the host: the state partitioned over the ranks."""
    return f"none on the host: the state partitioned over {f'{world} ranks' if world else 'the ranks'}"


def state_sharded(world: int | None = None) -> str:
    """How a plan and a recovery name sharding "optimizer_state"."""
    return f"optimizer state sharded over {f'{world} ranks' if world else 'the ranks'}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Rung:
    """One point of the search lattice: a setting of every knob except the micro-batch size.

    `checkpointing` is the coarse label ("selective" = some but not all repeated blocks recomputed);
    `checkpointed_blocks` is the count when the search chose one, None for the label's default (every
    other block for "selective", all for "full").
    """

    precision: str = "bf16"
    checkpointing: str = "none"
    offload: str = "none"
    checkpointed_blocks: int | None = None
    compile: bool = False
    optimizer_8bit: bool = False  # AdamW with 8-bit state (torchao or bitsandbytes): opt-in, it changes numerics

    def __post_init__(self) -> None:
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("checkpointing", self.checkpointing, CHECKPOINTING)
        check_choice("offload", self.offload, OFFLOAD)
        for name in ("compile", "optimizer_8bit"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Rung.{name} must be a bool, got {getattr(self, name)!r}")
        if self.optimizer_8bit and self.offload == "optimizer":
            raise ValueError("Rung.optimizer_8bit is for optimizers stepped on the device, not under optimizer offload")
        if self.checkpointed_blocks is None and self.checkpointing == "none":
            object.__setattr__(self, "checkpointed_blocks", 0)  # no recompute is 0 blocks, known or not
        blocks = self.checkpointed_blocks
        if blocks is not None:
            check_non_negative_int("Rung.checkpointed_blocks", blocks)
            if (blocks == 0) != (self.checkpointing == "none"):
                raise ValueError(f"Rung.checkpointed_blocks {blocks} disagrees with checkpointing "
                                 f"{self.checkpointing!r}: 0 blocks is 'none', 1 or more is 'selective' or 'full'")

    @property
    def name(self) -> str:
        """Short label, e.g. "bf16+full ckpt+optimizer offload" or "bf16+ckpt 12 blocks+compile"."""
        parts = [self.precision]
        if self.checkpointing == "selective" and self.checkpointed_blocks is not None:
            parts.append(f"ckpt {self.checkpointed_blocks} blocks")
        elif self.checkpointing != "none":
            parts.append(f"{self.checkpointing} ckpt")
        if self.offload != "none":
            parts.append(f"{self.offload} offload")
        if self.compile:
            parts.append("compile")
        if self.optimizer_8bit:
            parts.append("8-bit optimizer")
        return "+".join(parts)
