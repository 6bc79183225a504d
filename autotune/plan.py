"""`Plan`: the configuration autotune decided on, the evidence behind it, and where it comes from.

A plan is three frozen records: `Configuration` (what `apply`, a recovery and the cache key need),
`Evidence` (the trials, figures, and the search's account and the findings after it, which its reason renders)
and `Provenance` (cache key, source, device). Their fields read flat on the plan (`plan.micro_batch_size`,
`plan.reason`, `plan.key`). Steps after the search add a `Finding` (`with_finding`), never text. A plan
round-trips through a plain dict (`to_dict` / `from_dict`), the only form the cache and the CLI store or
print; a dict of another plan format raises `StalePlanFormat`, so an old cache row is tuned again, never misread.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

from torch import nn

from .configuration import RUNG_FIELDS, Configuration, Rung, state_sharded
from .errors import InvalidSetting
from .evidence import PLAN_FORMAT_VERSION, SOURCES, Evidence, Finding, Provenance, Trial
from .settings import DEFAULT_MARGIN
from .sizes import format_bytes, format_share
from .training.learned import NOTHING, Learned
from .training.step import TrainingStep
from .validate import dict_field

__all__ = ["PLAN_FORMAT_VERSION", "SOURCES", "Plan", "StalePlanFormat"]

T = TypeVar("T")
_PARTS = {"config": Configuration, "evidence": Evidence, "provenance": Provenance}


def _of_defaults(fields: dict[str, Any]) -> dict[str, Any]:
    """What `Plan.of` fills in for the fields a hand-made plan leaves out; the split of the global batch follows
    from the fields given, as the search derives it."""
    missing = [name for name in ("micro_batch_size", "memory_budget_bytes") if name not in fields]
    if "global_batch_size" not in fields and "accumulation_steps" not in fields:
        missing.append("global_batch_size (or accumulation_steps)")
    if missing:
        raise InvalidSetting(f"Plan.of() needs {', '.join(missing)}: e.g. Plan.of(precision='bf16', "
                             "micro_batch_size=8, global_batch_size=64, memory_budget_bytes=24 * 2**30)")
    micro, world = fields["micro_batch_size"], fields.get("world_size", 1)
    for name, n in (("micro_batch_size", micro), ("world_size", world)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidSetting(f"Plan.of() {name} must be a positive integer, got {n!r}")
    filled: dict[str, Any] = {"world_size": 1, "margin": DEFAULT_MARGIN, "peak_memory_bytes": 0,
                              "samples_per_second": 0.0}
    if "global_batch_size" in fields:
        per_rank = fields["global_batch_size"] // world
        filled["accumulation_steps"] = max(1, -(-per_rank // micro))
    else:
        per_rank = micro * fields["accumulation_steps"]
        filled["global_batch_size"] = per_rank * world
    steps = fields.get("accumulation_steps", filled.get("accumulation_steps"))
    if isinstance(steps, int) and isinstance(per_rank, int):
        filled["last_micro_batch_size"] = per_rank - (steps - 1) * micro
    return filled


class StalePlanFormat(ValueError):
    """A plan dict written in another plan format (an older autotune's flat record, or a newer one)."""


class _Read(Generic[T]):
    """A read-only flat attribute of `Plan`, read from the part (config, evidence, provenance) that holds it."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, plan: None, owner: type | None = None) -> _Read[T]: ...

    @overload
    def __get__(self, plan: Plan, owner: type | None = None) -> T: ...

    def __get__(self, plan: Plan | None, owner: type | None = None) -> T | _Read[T]:
        if plan is None:
            return self
        value: T = getattr(getattr(plan, self.part), self.name)
        return value


def _field_part(name: str) -> str | None:
    """Which part of a plan holds the flat field `name`, or None."""
    if name in RUNG_FIELDS or name == "rung":
        return "config"
    if name == "reason":  # a plan written by hand gives its reason as text: the account, with no findings
        return "evidence"
    return next((part for part, cls in _PARTS.items() if name in {f.name for f in dataclasses.fields(cls)}), None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The configuration autotune chose, with the evidence behind it and its provenance."""

    config: Configuration
    evidence: Evidence
    provenance: Provenance = field(default_factory=Provenance)
    # What `fit` learned for `apply` (its loss, its recovery recorder): kept with the object `fit` returned, never
    # compared, hashed or written (`training/learned.py`)
    learned: Learned = field(default=NOTHING, compare=False, hash=False, repr=False)

    rung = _Read[Rung]("config")
    precision = _Read[str]("config")
    checkpointing = _Read[str]("config")
    offload = _Read[str]("config")
    checkpointed_blocks = _Read[int | None]("config")
    compile = _Read[bool]("config")
    recompute_policy = _Read[str]("config")
    optimizer_8bit = _Read[bool]("config")
    fp8 = _Read[bool]("config")
    micro_batch_size = _Read[int]("config")
    accumulation_steps = _Read[int]("config")
    last_micro_batch_size = _Read[int]("config")
    world_size = _Read[int]("config")
    global_batch_size = _Read[int]("config")
    per_rank_batch_size = _Read[int]("config")
    min_micro_batch_size = _Read[int]("config")
    memory_budget_bytes = _Read[int]("config")
    margin = _Read[float]("config")
    offload_fraction = _Read[float]("config")
    offload_overlap = _Read[bool | None]("config")
    partitioned_state = _Read[bool]("config")
    sharding = _Read[str]("config")
    reduce_overlap = _Read[bool | None]("config")
    techniques = _Read[tuple[str, ...] | None]("config")
    block_paths = _Read[tuple[str, ...]]("config")
    max_length = _Read[int | None]("config")
    peak_memory_bytes = _Read[int]("evidence")
    samples_per_second = _Read[float]("evidence")
    tokens_per_second = _Read[float | None]("evidence")
    reason = _Read[str]("evidence")
    findings = _Read[tuple[Finding, ...]]("evidence")
    trials = _Read[tuple[Trial, ...]]("evidence")
    compile_seconds = _Read[float]("evidence")
    flops_per_sample = _Read[float | None]("evidence")
    mfu = _Read[float | None]("evidence")
    measured_samples_per_second = _Read[float | None]("evidence")
    host_peak_bytes = _Read[int | None]("evidence")
    key = _Read[str]("provenance")
    source = _Read[str]("provenance")
    device = _Read[str]("provenance")
    device_name = _Read[str]("provenance")
    format_version = _Read[int]("provenance")

    def __post_init__(self) -> None:
        for part, cls in _PARTS.items():
            if not isinstance(getattr(self, part), cls):
                raise ValueError(f"Plan.{part} must be a {cls.__name__}, got {type(getattr(self, part)).__name__}")

    @classmethod
    def of(cls, **fields: Any) -> Plan:
        """A plan written by hand from the fields a user knows, flat:
        `Plan.of(precision="bf16", checkpointing="full", micro_batch_size=8, global_batch_size=64,
        memory_budget_bytes=24 * 2**30)`.

        Needed: `micro_batch_size`, `memory_budget_bytes`, and `global_batch_size` or `accumulation_steps`
        (the other follows). Left out: one rank, fit's default margin, the rung's knobs at `Rung`'s defaults,
        the last micro-batch from the split, and the measured figures (`peak_memory_bytes`,
        `samples_per_second`) at 0, for none was measured.

        Raises:
            InvalidSetting: a needed field is missing (the message names it).
            TypeError: a field no part of a plan has.
            ValueError: a value out of range, or fields that disagree.
        """
        fields = {**_of_defaults(fields), **fields}
        parts: dict[str, dict[str, Any]] = {part: {} for part in _PARTS}
        for name, value in fields.items():
            part = _field_part(name)
            if part is None:
                raise TypeError(f"Plan.of() got an unexpected field {name!r}")
            parts[part]["account" if name == "reason" else name] = value
        return cls(config=Configuration.of(**parts["config"]), evidence=Evidence(**parts["evidence"]),
                   provenance=Provenance(**parts["provenance"]))

    def with_config(self, config: Configuration | None = None, **changes: Any) -> Plan:
        """This plan on `config` (or on its own configuration with `changes`, which may name the rung's knobs):
        what a recovery mid-training makes (with a `Finding` that says why: `with_finding`)."""
        config = config if config is not None else self.config
        return dataclasses.replace(self, config=config.replace(**changes) if changes else config)

    def with_evidence(self, **changes: Any) -> Plan:
        """This plan with `changes` to its evidence (trials, measured figures); `reason` given as text replaces
        the account and drops the findings, as for a plan written by hand."""
        if "reason" in changes:
            changes = {"findings": (), **changes, "account": changes["reason"]}
            del changes["reason"]
        return dataclasses.replace(self, evidence=dataclasses.replace(self.evidence, **changes))

    def with_finding(self, finding: Finding, *, once: bool = False) -> Plan:
        """This plan with `finding` after its others: how every step after the search adds to its reason. `once`:
        this plan as it is where its reason says the finding's clause already."""
        if once and finding.clause in self.reason:
            return self
        return dataclasses.replace(self, evidence=self.evidence.with_finding(finding))

    def with_provenance(self, **changes: Any) -> Plan:
        """This plan with `changes` to its provenance (key, source, device)."""
        return dataclasses.replace(self, provenance=dataclasses.replace(self.provenance, **changes))

    def apply(self, model: Any, optimizer: Any = None, *, loss_fn: Any = None, max_grad_norm: float | None = None,
              before_optimizer_step: Any = None, after_optimizer_step: Any = None) -> Any:
        """Apply this plan to `model` (and `optimizer`) and return the training step callable.

        `loss_fn` defaults to the one `autotune.fit` was given when it returned this plan object, else the
        model's own loss (a plan read from the cache or built by hand has none). `max_grad_norm` clips the whole
        global batch's gradient norm before each optimizer step; `before_optimizer_step(step)` /
        `after_optimizer_step(step)` run around it. See `autotune.training.step.TrainingStep`.

        Raises:
            InvalidSetting: `model` is not a `torch.nn.Module` (the optimizer passed first, a name, None), or
                `optimizer` is none of None, an optimizer or a factory.
        """
        if not isinstance(model, nn.Module):
            raise InvalidSetting(f"plan.apply needs the torch.nn.Module the plan was made for as its first argument, "
                                 f"got {type(model).__name__}; call plan.apply(model, optimizer)")
        loss_fn = loss_fn if loss_fn is not None else self.learned.loss_fn
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
        share = (f" of {format_share(self.offload_fraction)} of the parameters"
                 if self.offload == "optimizer" and 0 < self.offload_fraction < 1 else "")
        if self.partitioned_state:
            share = f", {state_sharded(self.world_size)}"
        share += " (serial)" if self.offload_overlap is False else ""
        share += ", gradients all-reduced after backward" if self.reduce_overlap is False else ""
        host = f", {format_bytes(self.host_peak_bytes)} on the host" if self.host_peak_bytes else ""
        measured = (f"{rate}; peak {format_bytes(self.peak_memory_bytes)} of {format_bytes(self.memory_budget_bytes)}"
                    if self.samples_per_second or self.peak_memory_bytes  # both 0: a plan written by hand
                    else f"not measured; budget {format_bytes(self.memory_budget_bytes)}")
        return (f"{self.rung.name}{share}, micro-batch {self.micro_batch_size} x {self.accumulation_steps} "
                f"accumulation x {self.world_size} rank(s) = {self.global_batch_size}; {measured}{host}{mfu}{trained}")

    def trial_mfu(self, trial: Trial) -> float | None:
        """A trial's MFU, from the plan's: the same FLOPs per sample on the same GPU, so it scales with
        throughput. None where the plan has no MFU, the trial no throughput, or another precision's peak."""
        if (self.mfu is None or not self.samples_per_second or trial.samples_per_second <= 0
                or trial.rung.precision != self.precision):
            return None
        return self.mfu * trial.samples_per_second / self.samples_per_second

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "evidence": self.evidence.to_dict(),
                "provenance": self.provenance.to_dict()}

    @classmethod
    def from_dict(cls, d: Any) -> Plan:
        """Rebuild a plan from `to_dict` output.

        Raises:
            StalePlanFormat: `d` was written in another plan format (re-tune it).
            ValueError: unknown fields or bad values.
        """
        if not isinstance(d, dict):
            raise ValueError(f"a plan must be a dict, got {type(d).__name__}")
        version = _format_of(d)
        if version != PLAN_FORMAT_VERSION:
            raise StalePlanFormat(f"plan format version {version} is not {PLAN_FORMAT_VERSION}; re-tune with "
                                  "retune=True or upgrade autotune")
        unknown = sorted(set(d) - set(_PARTS))
        if unknown:
            raise ValueError(f"unknown Plan field(s): {', '.join(unknown)}")
        return cls(config=Configuration.from_dict(d.get("config")), evidence=Evidence.from_dict(d.get("evidence")),
                   provenance=Provenance.from_dict(d.get("provenance")))

    @classmethod
    def from_flat_dict(cls, d: Any) -> Plan:
        """A plan written as one flat record (plan format 2, as older benchmark records hold it), read for
        display: its fields are this format's, only grouped otherwise. The cache never serves one (`from_dict`).

        Raises:
            ValueError: not a flat plan record, or bad values.
        """
        if not isinstance(d, dict) or "config" in d:
            raise ValueError("a flat plan record is a dict of plan fields (plan format 2)")
        fields = {k: v for k, v in d.items() if k not in ("format_version", "cache")}
        trials = fields.pop("trials", [])
        if not isinstance(trials, (list, tuple)):
            raise ValueError("Plan.trials must be a list")
        try:
            return cls.of(**fields, trials=tuple(Trial.from_dict(dict_field("Plan.trials[]", t)) for t in trials),
                          format_version=d.get("format_version", 1))
        except TypeError as exc:  # a field no plan has, or a required one missing
            raise ValueError(str(exc)) from None


def _format_of(d: dict[str, Any]) -> Any:
    """The plan format a dict was written in: its provenance's, else (a flat record) its own, else 1."""
    if "provenance" in d:
        return dict_field("Plan.provenance", d["provenance"]).get("format_version")
    return d.get("format_version", 1)
