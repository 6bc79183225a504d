"""`Plan`: the configuration autotune decided on, with the trials and the reason behind it.

It is a frozen, keyword-only dataclass that validates itself and round-trips through a plain dict
(`to_dict` / `from_dict`), which is the only form the cache and the CLI ever store or print.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .workload.batching import solve_accumulation
from .sizes import format_bytes
from .configuration import SHARDING, Rung, state_sharded
from .evidence import Trial
from .validate import check_choice, check_known_fields, check_non_negative_int, check_non_negative_number, \
    check_positive_int, dict_field

PLAN_FORMAT_VERSION = 2  # 2: compile, checkpointed blocks, offload fraction, sharding, FLOPs
SOURCES = ("tuned", "cache")
_LOCAL_FIELDS = ("cache",)  # Plan fields that live in this process only (see Plan.cache)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The configuration autotune chose, with the reason and every trial behind it."""

    precision: str
    checkpointing: str
    offload: str
    micro_batch_size: int
    accumulation_steps: int
    world_size: int
    global_batch_size: int
    last_micro_batch_size: int  # < micro_batch_size when the per-rank batch does not divide evenly (trained first: see TrainingStep._accumulate)
    peak_memory_bytes: int
    memory_budget_bytes: int
    margin: float
    samples_per_second: float
    tokens_per_second: float | None = None  # samples/s x tokens per sample, when the batch has a sequence
    device: str = "cuda"  # "cuda" | "cpu" (simulated ceiling)
    device_name: str = ""
    source: str = "tuned"
    reason: str = ""
    trials: tuple[Trial, ...] = field(default_factory=tuple)
    key: str = ""  # cache key, "" when the plan was never cached
    compile: bool = False  # torch.compile on the model (per block when blocks are recomputed)
    checkpointed_blocks: int | None = None  # repeated blocks recomputed in backward, 0..N; None where the
    # script decides (zero-change)
    compile_seconds: float = 0.0  # tuning time spent compiling, included in the tune's wall time
    offload_fraction: float | None = None  # share of parameters whose FP32 master and optimizer state live
    # on the host: None resolves to 1.0 under optimizer offload, else 0.0
    offload_overlap: bool | None = None  # optimizer offload steps the host during the last backward: fit
    # measures it both ways and keeps the faster; None (a plan made by hand, an older row) leaves it on
    sharding: str = "none"  # "none" | "fsdp2" | "optimizer_state" (`partitioned_state`)
    reduce_overlap: bool | None = None  # replicated on several ranks: the gradient all-reduce in buckets during
    # the last backward (True), or in one after it (False); fit times both and keeps the faster; None (one
    # rank, FSDP2 shards, a plan made by hand, an older row) is the buckets
    flops_per_sample: float | None = None  # forward+backward FLOPs of one sample, counted, not estimated
    mfu: float | None = None  # achieved FLOPs/s over the device's peak; None where the peak is unknown
    measured_samples_per_second: float | None = None  # what a real run under `autotune run` then trained
    # at (global batch over its median whole optimizer step); None until one did
    min_micro_batch_size: int = 1  # 2 for a model whose batch statistics need two samples (BatchNorm on
    # (N, C) or 1x1 maps): no micro-batch holds fewer, and the split is balanced (see `split_sizes`)
    techniques: tuple[str, ...] | None = None  # what fit was allowed: recovery climbs only within it
    # (None for a plan made by hand: the step's `techniques`, else all)
    optimizer_8bit: bool = False  # the optimizer keeps 8-bit state (techniques=(..., "optimizer_8bit"))
    block_paths: tuple[str, ...] = ()  # the repeated blocks (module paths), in the order checkpointing
    # recomputes them: the first checkpointed_blocks are; () where unknown (found again from the model)
    format_version: int = PLAN_FORMAT_VERSION
    host_peak_bytes: int | None = None  # host bytes the configuration allocates (offload's buffers); None: unknown
    max_length: int | None = None  # the longest sequence the trials ran (fit's max_length); None: not a token batch
    # The `PlanCache` `fit` read or wrote this plan in: where a recovery during training records the OOM and
    # the safer plan (never another cache). Local to this process: not stored, compared, printed or read back.
    cache: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.rung  # validates the knobs together  # noqa: B018
        if self.offload_fraction is None:
            object.__setattr__(self, "offload_fraction", 1.0 if self.offload == "optimizer" else 0.0)
        fraction = self.offload_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ValueError(f"Plan.offload_fraction must be in [0, 1], got {fraction!r}")
        if fraction > 0 and self.offload != "optimizer":
            raise ValueError(f"Plan.offload_fraction {fraction} disagrees with offload {self.offload!r}: "
                             "only optimizer offload puts a share of the parameters on the host")
        if self.offload_overlap is not None and not isinstance(self.offload_overlap, bool):
            raise ValueError(f"Plan.offload_overlap must be True, False or None, got {self.offload_overlap!r}")
        check_choice("Plan.sharding", self.sharding, SHARDING)
        if self.reduce_overlap is not None and not isinstance(self.reduce_overlap, bool):
            raise ValueError(f"Plan.reduce_overlap must be True, False or None, got {self.reduce_overlap!r}")
        if self.reduce_overlap is not None and (self.world_size < 2 or self.sharding == "fsdp2"):
            raise ValueError(f"Plan.reduce_overlap {self.reduce_overlap} times the gradient all-reduce of replicated "
                             f"ranks; this plan has world_size {self.world_size} and sharding {self.sharding!r}, "
                             "where autotune all-reduces nothing: leave it None")
        if isinstance(self.block_paths, list):  # as JSON gives it back
            object.__setattr__(self, "block_paths", tuple(self.block_paths))
        if not isinstance(self.block_paths, tuple) or not all(isinstance(p, str) for p in self.block_paths):
            raise ValueError(f"Plan.block_paths must be a tuple of module paths, got {self.block_paths!r}")
        check_non_negative_number("Plan.compile_seconds", self.compile_seconds)
        for name in ("flops_per_sample", "mfu", "measured_samples_per_second"):
            if getattr(self, name) is not None:
                check_non_negative_number(f"Plan.{name}", getattr(self, name))
        for name in ("micro_batch_size", "accumulation_steps", "world_size", "global_batch_size",
                     "last_micro_batch_size", "memory_budget_bytes"):
            check_positive_int(f"Plan.{name}", getattr(self, name))
        if self.offload == "optimizer" and fraction == 0:
            raise ValueError("Plan.offload_fraction 0 under optimizer offload is the optimizer state partitioned over "
                             "the ranks: use sharding='optimizer_state' with offload='none'")
        if self.partitioned_state and (self.world_size < 2 or self.offload != "none" or self.precision == "fp16"
                                       or self.optimizer_8bit):
            raise ValueError(
                "Plan.sharding 'optimizer_state' partitions the optimizer state over replicated ranks; this plan has "
                f"world_size {self.world_size}, offload {self.offload!r}, precision {self.precision!r}, where it "
                "would save nothing or cannot: use sharding='none'")
        check_non_negative_int("Plan.peak_memory_bytes", self.peak_memory_bytes)
        check_non_negative_number("Plan.samples_per_second", self.samples_per_second)
        if not isinstance(self.margin, (int, float)) or not 0 <= self.margin < 1:
            raise ValueError(f"Plan.margin must be in [0, 1), got {self.margin!r}")
        check_choice("Plan.source", self.source, SOURCES)
        check_choice("Plan.device", self.device, ("cuda", "cpu"))
        if self.last_micro_batch_size > self.micro_batch_size:
            raise ValueError("Plan.last_micro_batch_size cannot exceed Plan.micro_batch_size")
        per_rank = self.global_batch_size // self.world_size
        if per_rank * self.world_size != self.global_batch_size:
            raise ValueError(f"Plan.global_batch_size {self.global_batch_size} does not divide by "
                             f"world_size {self.world_size}")
        check_positive_int("Plan.min_micro_batch_size", self.min_micro_batch_size)
        if self.techniques is not None:
            if not isinstance(self.techniques, (list, tuple)) or not all(isinstance(t, str) for t in self.techniques):
                raise ValueError(f"Plan.techniques must be a list of technique names or None, got {self.techniques!r}")
            object.__setattr__(self, "techniques", tuple(self.techniques))  # a JSON list from the cache
        split = solve_accumulation(per_rank, self.micro_batch_size, self.min_micro_batch_size)
        covered = (self.accumulation_steps - 1) * self.micro_batch_size + self.last_micro_batch_size
        if split != (self.accumulation_steps, self.last_micro_batch_size):
            raise ValueError(f"Plan covers {covered} samples per rank but the global batch needs {per_rank}: "
                             "micro_batch_size, accumulation_steps and last_micro_batch_size disagree")
        if not all(isinstance(t, Trial) for t in self.trials):
            raise ValueError("Plan.trials must hold Trial objects")

    @property
    def rung(self) -> Rung:
        return Rung(precision=self.precision, checkpointing=self.checkpointing, offload=self.offload,
                    checkpointed_blocks=self.checkpointed_blocks, compile=self.compile,
                    optimizer_8bit=self.optimizer_8bit)

    @property
    def partitioned_state(self) -> bool:
        """Sharding "optimizer_state": on replicated ranks each rank keeps the FP32 masters and optimizer state of
        its 1/world of the parameters on the device, with 16-bit weights and gradients, and sends the weights it
        updated to the others (ZeRO stage 1; techniques/offload/partition.py)."""
        return self.sharding == "optimizer_state"

    @property
    def per_rank_batch_size(self) -> int:
        return self.global_batch_size // self.world_size

    def apply(self, model: Any, optimizer: Any = None, *, loss_fn: Any = None, max_grad_norm: float | None = None,
              before_optimizer_step: Any = None, after_optimizer_step: Any = None) -> Any:
        """Apply this plan to `model` (and `optimizer`) and return the training step callable.

        `loss_fn` defaults to the one `autotune.fit` was given for this model in this process, else the
        model's own loss. `max_grad_norm` clips the whole global batch's gradient norm before each optimizer
        step; `before_optimizer_step(step)` / `after_optimizer_step(step)` run around it. See
        `autotune.training.step.TrainingStep`.
        """
        from .training.step import TrainingStep  # step imports plan: import here to keep the graph acyclic
        from .workload.losses import fit_loss

        loss_fn = loss_fn if loss_fn is not None else fit_loss(model)
        return TrainingStep(self, model, optimizer, loss_fn=loss_fn, max_grad_norm=max_grad_norm,
                            before_optimizer_step=before_optimizer_step,
                            after_optimizer_step=after_optimizer_step)

    def summary(self) -> str:
        """One line: rung, micro-batch x accumulation, throughput, memory, and MFU where the GPU's peak is known."""
        rate = (f"{self.tokens_per_second:,.0f} tokens/s" if self.tokens_per_second
                else f"{self.samples_per_second:,.1f} samples/s")
        mfu = f"; MFU {self.mfu:.1%}" if self.mfu is not None else ""
        trained = (f"; a real run trained at {self.measured_samples_per_second:,.1f} samples/s"
                   if self.measured_samples_per_second is not None else "")
        share = (f" of {self.offload_fraction:.0%} of the parameters"
                 if self.offload == "optimizer" and 0 < self.offload_fraction < 1 else "")
        if self.partitioned_state:
            share = f", {state_sharded(self.world_size)}"
        share += " (serial)" if self.offload_overlap is False else ""
        share += ", gradients all-reduced after backward" if self.reduce_overlap is False else ""
        host = f", {format_bytes(self.host_peak_bytes)} on the host" if self.host_peak_bytes else ""
        return (f"{self.rung.name}{share}, micro-batch {self.micro_batch_size} x {self.accumulation_steps} "
                f"accumulation x {self.world_size} rank(s) = {self.global_batch_size}; {rate}; "
                f"peak {format_bytes(self.peak_memory_bytes)} of {format_bytes(self.memory_budget_bytes)}"
                f"{host}{mfu}{trained}")

    def trial_mfu(self, trial: Trial) -> float | None:
        """A trial's MFU, from the plan's: the same FLOPs per sample on the same GPU, so it scales with
        throughput. None where the plan has no MFU, the trial no throughput, or another precision's peak."""
        if (self.mfu is None or not self.samples_per_second or trial.samples_per_second <= 0
                or trial.rung.precision != self.precision):
            return None
        return self.mfu * trial.samples_per_second / self.samples_per_second

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _LOCAL_FIELDS}
        d["trials"] = [t.to_dict() for t in self.trials]
        d["block_paths"] = list(self.block_paths)  # as JSON will give it back
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Rebuild a plan from `to_dict` output; unknown fields and bad values raise `ValueError`."""
        if not isinstance(d, dict):
            raise ValueError(f"a plan must be a dict, got {type(d).__name__}")
        check_known_fields("Plan", d, cls, local=_LOCAL_FIELDS)
        d = dict(d)
        trials = d.get("trials", [])
        if not isinstance(trials, (list, tuple)):
            raise ValueError("Plan.trials must be a list")
        d["trials"] = tuple(Trial.from_dict(dict_field("Plan.trials[]", t)) for t in trials)
        version = d.get("format_version", PLAN_FORMAT_VERSION)
        if version != PLAN_FORMAT_VERSION:
            raise ValueError(f"plan format version {version} is not {PLAN_FORMAT_VERSION}; re-tune "
                             "with retune=True or upgrade autotune")
        return cls(**d)
