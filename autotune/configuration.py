"""What a plan sets: `Rung`, one point of the search lattice, the choices each knob takes, and
`Configuration`, a rung with the batch split and the limits it was chosen under."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import InvalidSetting
from .validate import check_choice, check_known_fields, check_non_negative_int, check_positive_int, dict_field
from .workload.batching import solve_accumulation

PRECISIONS = ("bf16", "fp16", "fp32")
CHECKPOINTING = ("none", "selective", "full")
# "saved_activations": what autograd saves inside the blocks not recomputed streams to the host behind compute
# (`techniques/offload/activations.py`); "activations": the recomputed blocks' inputs parked on the host. In order
# of strength (recovery climbs it)
OFFLOAD = ("none", "saved_activations", "activations", "optimizer")
# "optimizer_state": replicated ranks, each keeping the FP32 masters and optimizer state of its 1/world of the
# parameters on its device (ZeRO stage 1, `Plan.partitioned_state`); "hsdp": FSDP2 over a 2-D mesh, sharded within
# each node and replicated across nodes (hybrid sharding: only the shards' gradient all-reduce crosses nodes)
SHARDING = ("none", "fsdp2", "optimizer_state", "hsdp")
FSDP = ("fsdp2", "hsdp")  # the shardings FSDP2 runs: parameters, gradients and optimizer state sharded
# What a recomputed block keeps (techniques/recompute_policy.py): nothing, or its matmuls' and attention's outputs
WHOLE_BLOCK = "whole_block"
RECOMPUTE_POLICIES = (WHOLE_BLOCK, "save_matmuls", "save_half_matmuls")


def state_sharded(world: int | None = None) -> str:
    """How a plan, a trial and a recovery name sharding "optimizer_state"."""
    return f"optimizer state sharded over {f'{world} ranks' if world else 'the ranks'}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Rung:
    """One point of the search lattice: a setting of every knob except the micro-batch size.

    `checkpointing` is the coarse label ("selective" = some but not all repeated blocks recomputed);
    `checkpointed_blocks` is the count when the search chose one, None for the label's default (every
    other block for "selective", all for "full"). `recompute_policy` is what a recomputed block keeps:
    nothing ("whole_block"), or its matmuls' and attention's outputs ("save_matmuls", "save_half_matmuls":
    see `techniques/recompute_policy.py`).
    """

    precision: str = "bf16"
    checkpointing: str = "none"
    offload: str = "none"
    checkpointed_blocks: int | None = None
    compile: bool = False
    optimizer_8bit: bool = False  # AdamW with 8-bit state (torchao or bitsandbytes): opt-in, it changes numerics
    fp8: bool = False  # torchao's float8 matmuls in the linear layers (CUDA 8.9+): opt-in, it changes numerics
    recompute_policy: str = WHOLE_BLOCK  # one of RECOMPUTE_POLICIES

    def __post_init__(self) -> None:
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("checkpointing", self.checkpointing, CHECKPOINTING)
        check_choice("offload", self.offload, OFFLOAD)
        for name in ("compile", "optimizer_8bit", "fp8"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Rung.{name} must be a bool, got {getattr(self, name)!r}")
        if self.optimizer_8bit and self.offload == "optimizer":
            raise ValueError("Rung.optimizer_8bit is for optimizers stepped on the device, not under optimizer offload")
        if self.fp8 and self.precision != "bf16":
            raise ValueError(f"Rung.fp8 runs the linear layers' matmuls in float8 beside bf16 autocast; precision "
                             f"is {self.precision!r}: use precision='bf16'")
        if self.checkpointed_blocks is None and self.checkpointing == "none":
            object.__setattr__(self, "checkpointed_blocks", 0)  # no recompute is 0 blocks, known or not
        blocks = self.checkpointed_blocks
        if blocks is not None:
            check_non_negative_int("Rung.checkpointed_blocks", blocks)
            if (blocks == 0) != (self.checkpointing == "none"):
                raise ValueError(f"Rung.checkpointed_blocks {blocks} disagrees with checkpointing "
                                 f"{self.checkpointing!r}: 0 blocks is 'none', 1 or more is 'selective' or 'full'")
        self._check_recompute_policy()

    def _check_recompute_policy(self) -> None:
        policy = self.recompute_policy
        if policy not in RECOMPUTE_POLICIES:
            raise InvalidSetting(f"recompute_policy must be one of {', '.join(RECOMPUTE_POLICIES)}; got {policy!r}")
        if policy != WHOLE_BLOCK and self.checkpointing == "none":
            raise InvalidSetting(f"recompute_policy {policy!r} says what a recomputed block keeps, but checkpointing "
                                 f"is 'none': no block is recomputed. Use checkpointing='selective' or 'full' with "
                                 f"it, or recompute_policy={WHOLE_BLOCK!r}")
        if policy != WHOLE_BLOCK and self.compile:
            # A recomputed block is compiled inside its checkpoint (techniques/compile.py): torch's selective
            # checkpoint then sees the compiled graph's library calls (aten.addmm.out), not the block's operators.
            raise InvalidSetting(f"recompute_policy {policy!r} keeps operators' outputs inside a recomputed block, "
                                 "but under compile the block is compiled inside its checkpoint, where torch's "
                                 "selective checkpoint sees only the compiled graph's library calls, not the block's "
                                 f"operators. Use recompute_policy={WHOLE_BLOCK!r} with compile, or compile=False")

    @property
    def name(self) -> str:
        """Short label, e.g. "bf16+full ckpt+optimizer offload" or "bf16+ckpt 12 blocks+compile"."""
        parts = [self.precision]
        if self.checkpointing == "selective" and self.checkpointed_blocks is not None:
            parts.append(f"ckpt {self.checkpointed_blocks} blocks")
        elif self.checkpointing != "none":
            parts.append(f"{self.checkpointing} ckpt")
        if self.recompute_policy != WHOLE_BLOCK:  # what the recomputed blocks keep, beside the checkpointing
            parts[-1] += " keeping " + ("half the matmuls" if self.recompute_policy == "save_half_matmuls"
                                        else "matmuls")
        if self.offload != "none":
            parts.append(f"{self.offload.replace('_', ' ')} offload")
        if self.compile:
            parts.append("compile")
        if self.optimizer_8bit:
            parts.append("8-bit optimizer")
        if self.fp8:
            parts.append("fp8")
        return "+".join(parts)


RUNG_FIELDS = ("precision", "checkpointing", "offload", "checkpointed_blocks", "compile", "optimizer_8bit", "fp8",
               "recompute_policy")


@dataclass(frozen=True, kw_only=True, slots=True)
class Configuration:
    """What a plan sets: the rung, the split of the batch, where the optimizer state lives, and the limits
    it was chosen under. Everything `Plan.apply`, a recovery and the cache key need; nothing measured.

    Large: a record, one field per setting a plan fixes; its methods are checks of those fields and read-only
    views of the rung's, with no behaviour to split off.
    """

    rung: Rung
    micro_batch_size: int
    accumulation_steps: int
    world_size: int
    global_batch_size: int
    last_micro_batch_size: int  # < micro_batch_size when the per-rank batch does not divide evenly (trained first)
    memory_budget_bytes: int
    margin: float
    min_micro_batch_size: int = 1  # 2 for a model whose batch statistics need two samples (BatchNorm on
    # (N, C) or 1x1 maps): no micro-batch holds fewer, and the split is balanced (see `split_sizes`)
    offload_fraction: float | None = None  # share of parameters whose FP32 master and optimizer state live
    # on the host: None resolves to 1.0 under optimizer offload, else 0.0
    offload_overlap: bool | None = None  # optimizer offload steps the host during the last backward; None
    # (a configuration made by hand) leaves it on
    sharding: str = "none"  # one of SHARDING
    reduce_overlap: bool | None = None  # replicated ranks: the gradient all-reduce in buckets during the last
    # backward (True), or in one after it (False); None (one rank, FSDP2 shards, made by hand) is the buckets
    techniques: tuple[str, ...] | None = None  # what fit was allowed: recovery climbs only within it
    # (None for a configuration made by hand: the step's `techniques`, else all)
    block_paths: tuple[str, ...] = ()  # the repeated blocks (module paths), in the order checkpointing
    # recomputes them: the first checkpointed_blocks are; () where unknown (found again from the model)
    max_length: int | None = None  # the longest sequence the trials ran (fit's max_length); None: not a token batch
    nodes: int = 1  # the machines the ranks spread over, world_size / nodes on each (torchrun's LOCAL_WORLD_SIZE)

    def __post_init__(self) -> None:
        if not isinstance(self.rung, Rung):
            raise ValueError(f"Configuration.rung must be a Rung, got {type(self.rung).__name__}")
        self._check_offload()
        check_choice("Configuration.sharding", self.sharding, SHARDING)
        self._check_reduce_overlap()
        for name in ("block_paths", "techniques"):
            value = getattr(self, name)
            if isinstance(value, list):  # as JSON gives it back
                object.__setattr__(self, name, tuple(value))
        if not isinstance(self.block_paths, tuple) or not all(isinstance(p, str) for p in self.block_paths):
            raise ValueError(f"Configuration.block_paths must be a tuple of module paths, got {self.block_paths!r}")
        if self.techniques is not None and (not isinstance(self.techniques, tuple)
                                            or not all(isinstance(t, str) for t in self.techniques)):
            raise ValueError(f"Configuration.techniques must be a list of technique names or None, "
                             f"got {self.techniques!r}")
        if self.max_length is not None:
            check_non_negative_int("Configuration.max_length", self.max_length)
        if not isinstance(self.margin, (int, float)) or isinstance(self.margin, bool) or not 0 <= self.margin < 1:
            raise ValueError(f"Configuration.margin must be in [0, 1), got {self.margin!r}")
        self._check_split()

    def _check_offload(self) -> None:
        if self.offload_fraction is None:
            object.__setattr__(self, "offload_fraction", 1.0 if self.offload == "optimizer" else 0.0)
        fraction = self.offload_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ValueError(f"Configuration.offload_fraction must be in [0, 1], got {fraction!r}")
        if fraction > 0 and self.offload != "optimizer":
            raise ValueError(f"Configuration.offload_fraction {fraction} disagrees with offload {self.offload!r}: "
                             "only optimizer offload puts a share of the parameters on the host")
        if self.offload_overlap is not None and not isinstance(self.offload_overlap, bool):
            raise ValueError(f"Configuration.offload_overlap must be True, False or None, got {self.offload_overlap!r}")

    def _check_reduce_overlap(self) -> None:
        if self.reduce_overlap is not None and not isinstance(self.reduce_overlap, bool):
            raise ValueError(f"Configuration.reduce_overlap must be True, False or None, got {self.reduce_overlap!r}")
        if self.reduce_overlap is not None and (self.world_size < 2 or self.sharding in FSDP):
            raise ValueError(f"Configuration.reduce_overlap {self.reduce_overlap} times the gradient all-reduce of "
                             f"replicated ranks; this configuration has world_size {self.world_size} and sharding "
                             f"{self.sharding!r}, where autotune all-reduces nothing: leave it None")

    def _check_split(self) -> None:
        for name in ("micro_batch_size", "accumulation_steps", "world_size", "global_batch_size",
                     "last_micro_batch_size", "memory_budget_bytes", "min_micro_batch_size"):
            check_positive_int(f"Configuration.{name}", getattr(self, name))
        if self.offload == "optimizer" and self.offload_fraction == 0:
            raise ValueError("Configuration.offload_fraction 0 under optimizer offload is the optimizer state "
                             "partitioned over the ranks: use sharding='optimizer_state' with offload='none'")
        if self.partitioned_state and (self.world_size < 2 or self.offload != "none" or self.precision == "fp16"
                                       or self.optimizer_8bit):
            raise ValueError(
                "Configuration.sharding 'optimizer_state' partitions the optimizer state over replicated ranks; this "
                f"configuration has world_size {self.world_size}, offload {self.offload!r}, precision "
                f"{self.precision!r}, where it would save nothing or cannot: use sharding='none'")
        self._check_nodes()
        if self.last_micro_batch_size > self.micro_batch_size:
            raise ValueError("Configuration.last_micro_batch_size cannot exceed Configuration.micro_batch_size")
        per_rank = self.global_batch_size // self.world_size
        if per_rank * self.world_size != self.global_batch_size:
            raise ValueError(f"Configuration.global_batch_size {self.global_batch_size} does not divide by "
                             f"world_size {self.world_size}")
        split = solve_accumulation(per_rank, self.micro_batch_size, self.min_micro_batch_size)
        covered = (self.accumulation_steps - 1) * self.micro_batch_size + self.last_micro_batch_size
        if split != (self.accumulation_steps, self.last_micro_batch_size):
            raise ValueError(f"the configuration covers {covered} samples per rank but the global batch needs "
                             f"{per_rank}: micro_batch_size, accumulation_steps and last_micro_batch_size disagree")

    def _check_nodes(self) -> None:
        check_positive_int("Configuration.nodes", self.nodes)
        if self.world_size % self.nodes:
            raise ValueError(f"Configuration.nodes {self.nodes} does not divide world_size {self.world_size}: every "
                             "node runs as many ranks")
        if self.sharding == "hsdp" and self.nodes < 2:
            raise ValueError("Configuration.sharding 'hsdp' shards within each node and replicates across nodes; "
                             f"this configuration has {self.nodes} node: use sharding='fsdp2'")

    @classmethod
    def of(cls, **fields: Any) -> Configuration:
        """A configuration from flat fields: the rung's knobs (precision, checkpointing...) by name, or `rung`;
        knobs left out take `Rung`'s defaults."""
        knobs = {name: fields.pop(name) for name in RUNG_FIELDS if name in fields}
        if knobs and "rung" in fields:
            raise TypeError(f"give either rung or its knobs ({', '.join(knobs)}), not both")
        fields.setdefault("rung", Rung(**knobs))
        return cls(**fields)

    def replace(self, **changes: Any) -> Configuration:
        """This configuration with `changes`, which may name the rung's knobs (precision, offload...) directly.
        A change of offload without an `offload_fraction` resolves the fraction again, and checkpointing turned
        on without a `checkpointed_blocks` takes the label's default count."""
        knobs = {name: changes.pop(name) for name in RUNG_FIELDS if name in changes}
        if knobs.get("offload", self.offload) != self.offload:
            changes.setdefault("offload_fraction", None)
        if knobs.get("checkpointing", "none") != "none" and self.checkpointed_blocks == 0:
            knobs.setdefault("checkpointed_blocks", None)  # the new label's default count
        if knobs.get("checkpointing") == "none":
            knobs.setdefault("recompute_policy", WHOLE_BLOCK)  # no block recomputed keeps nothing of one
        if knobs:
            changes["rung"] = dataclasses.replace(changes.get("rung", self.rung), **knobs)
        return dataclasses.replace(self, **changes)

    @property
    def precision(self) -> str:
        return self.rung.precision

    @property
    def checkpointing(self) -> str:
        return self.rung.checkpointing

    @property
    def offload(self) -> str:
        return self.rung.offload

    @property
    def checkpointed_blocks(self) -> int | None:
        return self.rung.checkpointed_blocks

    @property
    def compile(self) -> bool:
        return self.rung.compile

    @property
    def recompute_policy(self) -> str:
        return self.rung.recompute_policy

    @property
    def optimizer_8bit(self) -> bool:
        return self.rung.optimizer_8bit

    @property
    def fp8(self) -> bool:
        return self.rung.fp8

    @property
    def partitioned_state(self) -> bool:
        """Sharding "optimizer_state": on replicated ranks each rank keeps the FP32 masters and optimizer state of
        its 1/world of the parameters on the device, with 16-bit weights and gradients, and sends the weights it
        updated to the others (ZeRO stage 1)."""
        return self.sharding == "optimizer_state"

    @property
    def shard_ranks(self) -> int:
        """Over how many ranks each parameter is sharded: all of them under FSDP2, a node's under hybrid sharding,
        none (1) with the model replicated."""
        return {"fsdp2": self.world_size, "hsdp": self.world_size // self.nodes}.get(self.sharding, 1)

    @property
    def per_rank_batch_size(self) -> int:
        return self.global_batch_size // self.world_size

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["rung"] = dataclasses.asdict(self.rung)
        d["block_paths"] = list(self.block_paths)  # as JSON will give it back
        d["techniques"] = None if self.techniques is None else list(self.techniques)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Configuration:
        """Rebuild a configuration from `to_dict` output; unknown fields and bad values raise `ValueError`."""
        d = dict(dict_field("Plan.config", d))
        check_known_fields("Configuration", d, cls)
        d["rung"] = Rung(**dict_field("Configuration.rung", d.get("rung")))
        return cls(**d)
