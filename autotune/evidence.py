"""What a plan knows beside its configuration: `Trial`, one measured configuration; `Finding`, what a step after
the search found (a second search beside it, the loss check, a verification here, a recovery in training);
`Evidence`, the trials and figures a plan was chosen on, the search's account and the findings, which `render`
makes the plan's reason; `Provenance`, where the plan comes from."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .configuration import Rung
from .validate import (
    check_choice,
    check_known_fields,
    check_non_negative_int,
    check_non_negative_number,
    check_positive_int,
    dict_field,
)

NOISY = "noisy timings"  # how a noisy trial's note says so (the plan's reason counts the `noisy` ones)
# error: the configuration raised an error other than an OOM (compile's, a kernel this device lacks); non_finite:
# its loss was NaN or infinite. The search goes on without either.
OUTCOMES = ("ok", "oom", "over_budget", "error", "non_finite")
# A trial's phases, in the order they run: applying the configuration (its FP32 copy and casts included), the
# offloaded optimizer's host buffers, compiling (the warm-up beyond a steady step, compiled configurations only),
# the rest of the warm-up, the measured steps, putting the weights back, and giving the memory back.
TRIAL_PHASES = ("set-up", "host buffers", "compile", "warm-up", "measured", "restore", "clean-up")


def check_phases(name: str, phases: Any) -> None:
    """`phases` must map phase names to non-negative seconds."""
    if not isinstance(phases, dict):
        raise ValueError(f"{name} must be a dict of phase name -> seconds, got {type(phases).__name__}")
    for key, seconds in phases.items():
        if not isinstance(key, str):
            raise ValueError(f"{name} keys must be phase names, got {key!r}")
        check_non_negative_number(f"{name}[{key!r}]", seconds)


@dataclass(frozen=True, kw_only=True, slots=True)
class Trial:
    """One measured trial: a rung at a micro-batch size, and what happened.

    Large: a record, one field per measurement a trial reports, each read by the search, the reason or the
    cache; no behaviour to split off.
    """

    rung: Rung
    micro_batch_size: int
    outcome: str  # "ok" | "oom" | "over_budget" (ran, but its peak left less than the margin) | "error" | "non_finite"
    peak_bytes: int = 0  # peak device memory seen (reserved on CUDA, live storage under the simulation)
    seconds: float = 0.0  # wall time of the whole trial, set-up and clean-up included
    step_seconds: float = 0.0  # median forward+backward time of one micro-batch, from the second step on
    optimizer_seconds: float = 0.0  # median optimizer.step() time
    samples_per_second: float = 0.0  # estimated for a whole global step at this micro-batch
    alloc_retries: int = 0  # allocator retries (cudaFree + retry) during the measured steps
    compile_seconds: float = 0.0  # warm-up time beyond a measured step: what compiling cost this trial
    # Replicated on several ranks: what the gradient all-reduce, overlapped with a last micro-batch's backward
    # as in training, added to that micro-batch; counted in `optimizer_seconds` (a cost once per global step).
    reduce_seconds: float = 0.0
    # The same, with every gradient in one all-reduce after backward (`Plan.reduce_overlap` False); measured
    # only by the trial that times both (`search/reduce_timing.py`), else 0.
    reduce_after_seconds: float = 0.0
    host_peak_bytes: int = 0  # how far the process's resident host memory rose during the trial (measured)
    noisy: bool = False  # its step times spread wide (on this rank or another): the plan's reason counts these
    overlapped: bool = False  # its measured steps overlapped the host optimizer with the last backward
    # "optimizer_state": its optimizer state partitioned over the replicated ranks, as a plan's `sharding` names
    # it; "none" for every other trial (the search runs its FSDP2 shardings on a sharded model, not per trial)
    sharding: str = "none"
    note: str = ""  # for people: what happened, in words; decisions read the fields above
    # Where `seconds` went, in order: set-up, host buffers, compile, warm-up, measured, restore, clean-up (seconds
    # each; `TRIAL_PHASES`); empty for a trial recorded before trials timed their phases. Not hashed: a dict.
    phases: dict[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.rung, Rung):
            raise ValueError(f"Trial.rung must be a Rung, got {type(self.rung).__name__}")
        check_positive_int("Trial.micro_batch_size", self.micro_batch_size)
        check_choice("Trial.outcome", self.outcome, OUTCOMES)
        check_choice("Trial.sharding", self.sharding, ("none", "optimizer_state"))
        for name in ("peak_bytes", "alloc_retries", "host_peak_bytes"):
            check_non_negative_int(f"Trial.{name}", getattr(self, name))
        for name in ("seconds", "step_seconds", "optimizer_seconds", "samples_per_second", "compile_seconds",
                     "reduce_seconds", "reduce_after_seconds"):
            check_non_negative_number(f"Trial.{name}", getattr(self, name))
        for name in ("noisy", "overlapped"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Trial.{name} must be a bool, got {getattr(self, name)!r}")
        check_phases("Trial.phases", self.phases)

    @property
    def fits(self) -> bool:
        return self.outcome == "ok"

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["rung"] = dataclasses.asdict(self.rung)
        d["phases"] = dict(self.phases)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trial:
        check_known_fields("Trial", d, cls)
        d = dict(d)
        d["rung"] = Rung(**dict_field("Trial.rung", d.get("rung")))
        return cls(**d)


# The search's steps after its pick, each a kind of finding: the host share of an offloaded optimizer, the optimizer
# state partitioned over ranks, the host optimizer overlapping the last backward, when the all-reduce runs, and the
# pick's rate at the example's own length (where the trials ran at max_length).
STEPS_AFTER_PICK = ("offload share", "partitioned state", "offload overlap", "reduce timing", "typical length")
# What a finding is about: a step after the search's pick (`STEPS_AFTER_PICK`), which of two measured plans was
# kept ("sharding": replicated or FSDP2; "hybrid": flat or hybrid sharding), a second search that found nothing or
# failed, a note of the loss check, a verification trial here, a recovery in training (an OOM's, the split balanced
# for batch statistics, the micro-batch grown back), and the search's notes ("note": what was left out and why,
# the decisions every trial ran under), its noise and, under `autotune run`, a trial's start-up.
FINDING_KINDS = ("sharding", "hybrid", "nothing fits", "search failed", "loss", "verified", "recovered", "balanced",
                 "grown", "note", "noise", "startup", *STEPS_AFTER_PICK)
# Where a finding's clause goes in the reason: after what is said so far, before it (a decision that changed what
# every trial ran on), before it as what came of it ("leads": "clause; then: ...", a step that replaced the pick),
# or instead of it (a recovery: the plan is no longer the one the account was of).
PLACES = ("after", "before", "leads", "instead")


@dataclass(frozen=True, kw_only=True, slots=True)
class Finding:
    """What one step after the search found, for the plan's reason: `clause` in words, the figures and the
    `subject` it names as fields (what tests and tools read), and where the clause goes (`place`)."""

    kind: str  # one of FINDING_KINDS
    clause: str
    subject: str = ""  # what the finding is about, where its kind names several (a second search's placement)
    figures: dict[str, float] = field(default_factory=dict, hash=False)  # the numbers the clause says, by name
    place: str = "after"  # one of PLACES

    def __post_init__(self) -> None:
        check_choice("Finding.kind", self.kind, FINDING_KINDS)
        check_choice("Finding.place", self.place, PLACES)
        for name in ("clause", "subject"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"Finding.{name} must be a string, got {type(getattr(self, name)).__name__}")
        if not self.clause:
            raise ValueError("Finding.clause must say what was found, got an empty string")
        if not isinstance(self.figures, dict):
            raise ValueError(f"Finding.figures must be a dict of name -> number, got {type(self.figures).__name__}")
        for key, value in self.figures.items():
            if not isinstance(key, str):
                raise ValueError(f"Finding.figures keys must be names, got {key!r}")
            check_non_negative_number(f"Finding.figures[{key!r}]", value)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["figures"] = dict(self.figures)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Finding:
        d = dict_field("Evidence.findings[]", d)
        check_known_fields("Finding", d, cls)
        return cls(**d)


def render(account: str, findings: Iterable[Finding]) -> str:
    """The plan's reason: the search's `account`, then each finding's clause in the order found, joined by "; ".
    The one place a reason is written: every step after the search adds a `Finding`, never text."""
    text = account
    for f in findings:
        if f.place == "instead" or not text:
            text = f.clause
        elif f.place == "before":
            text = f"{f.clause}; {text}"
        elif f.place == "leads":
            text = f"{f.clause}; then: {text}"
        else:
            text = f"{text}; {f.clause}"
    return text


@dataclass(frozen=True, kw_only=True, slots=True)
class Evidence:
    """What the trials measured of a plan's configuration, and why it was chosen: the search's `account` and the
    `findings` after it, which `reason` renders."""

    peak_memory_bytes: int
    samples_per_second: float
    tokens_per_second: float | None = None  # samples/s x tokens per sample, when the batch has a sequence
    account: str = ""  # the search's account of its pick (or a hand-made plan's reason), as it composed it
    findings: tuple[Finding, ...] = ()  # what steps after the search found, in order: `reason` says each
    trials: tuple[Trial, ...] = ()
    compile_seconds: float = 0.0  # tuning time spent compiling, included in the tune's wall time
    flops_per_sample: float | None = None  # forward+backward FLOPs of one sample, counted, not estimated
    mfu: float | None = None  # achieved FLOPs/s over the device's peak; None where the peak is unknown
    measured_samples_per_second: float | None = None  # what a real run under `autotune run` then trained
    # at (global batch over its median whole optimizer step); None until one did
    host_peak_bytes: int | None = None  # host bytes the configuration allocates (offload's buffers); None: unknown
    tune_seconds: float = 0.0  # the tune's wall time, from fit's call to the plan (0: not tuned here, or unknown)
    # Where the tune's time outside the trials went (the loss check, the cache look-up, the model's snapshot and
    # its putting back, the search's set-up, "other"); the trials' own time is in their `phases`.
    tune_phases: dict[str, float] = field(default_factory=dict, hash=False)
    # Cut short by max_tune_seconds: how many configurations the search left untried (the plan is the best found
    # in time, and the cache serves it only to a fit that bounds its tune too); None: the search ran to its end.
    untried: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.trials, list):  # as JSON gives it back
            object.__setattr__(self, "trials", tuple(self.trials))
        if not isinstance(self.trials, tuple) or not all(isinstance(t, Trial) for t in self.trials):
            raise ValueError("Evidence.trials must hold Trial objects")
        check_non_negative_int("Evidence.peak_memory_bytes", self.peak_memory_bytes)
        for name in ("samples_per_second", "compile_seconds"):
            check_non_negative_number(f"Evidence.{name}", getattr(self, name))
        for name in ("tokens_per_second", "flops_per_sample", "mfu", "measured_samples_per_second"):
            if getattr(self, name) is not None:
                check_non_negative_number(f"Evidence.{name}", getattr(self, name))
        if self.host_peak_bytes is not None:
            check_non_negative_number("Evidence.host_peak_bytes", self.host_peak_bytes)
        check_non_negative_number("Evidence.tune_seconds", self.tune_seconds)
        check_phases("Evidence.tune_phases", self.tune_phases)
        if self.untried is not None:
            check_non_negative_int("Evidence.untried", self.untried)
        if not isinstance(self.account, str):
            raise ValueError(f"Evidence.account must be a string, got {type(self.account).__name__}")
        if isinstance(self.findings, list):  # as JSON gives it back
            object.__setattr__(self, "findings", tuple(self.findings))
        if not isinstance(self.findings, tuple) or not all(isinstance(f, Finding) for f in self.findings):
            raise ValueError("Evidence.findings must hold Finding objects")

    @property
    def reason(self) -> str:
        """Why the plan was chosen, in words: the search's account and every finding after it (`render`)."""
        return render(self.account, self.findings)

    def to_dict(self) -> dict[str, Any]:
        """The evidence as a dict, "reason" the rendered text where the account stood; the account and the
        findings beside it only where there are findings (so a plan without any reads as it always did)."""
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "account":
                d["reason"] = self.reason
            elif f.name != "findings":
                d[f.name] = getattr(self, f.name)
        if self.findings:
            d["account"], d["findings"] = self.account, [f.to_dict() for f in self.findings]
        d["trials"] = [t.to_dict() for t in self.trials]
        d["tune_phases"] = dict(self.tune_phases)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Evidence:
        """Rebuild evidence from `to_dict` output; unknown fields and bad values raise `ValueError`, and so does
        a stored reason that is not what the stored account and findings render."""
        d = dict(dict_field("Plan.evidence", d))
        said = d.pop("reason", "")
        if "findings" not in d:  # the reason is the account itself
            if "account" in d:
                raise ValueError("Evidence.account is stored only beside findings")
            d["account"] = said
        check_known_fields("Evidence", d, cls)
        trials = d.get("trials", [])
        if not isinstance(trials, (list, tuple)):
            raise ValueError("Evidence.trials must be a list")
        d["trials"] = tuple(Trial.from_dict(dict_field("Evidence.trials[]", t)) for t in trials)
        findings = d.get("findings", [])
        if not isinstance(findings, (list, tuple)):
            raise ValueError("Evidence.findings must be a list")
        d["findings"] = tuple(Finding.from_dict(f) for f in findings)
        evidence = cls(**d)
        if evidence.reason != said:
            raise ValueError("Evidence.reason is not what its account and findings say: the row was edited")
        return evidence

    def with_finding(self, finding: Finding) -> Evidence:
        """This evidence with `finding` after the others; a finding said instead of the reason (a recovery: the plan
        is no longer the one they were about) replaces the account and them."""
        if finding.place == "instead":
            return dataclasses.replace(self, account="", findings=(finding,))
        return dataclasses.replace(self, findings=(*self.findings, finding))

    def with_texts(self, text: Callable[[str], str]) -> Evidence:
        """This evidence with `text` applied to every text it carries (the account, the findings' clauses and
        subjects, the trials' notes): how the cache makes a plan from elsewhere printable."""
        findings = tuple(dataclasses.replace(f, clause=text(f.clause), subject=text(f.subject)) for f in self.findings)
        trials = tuple(dataclasses.replace(t, note=text(t.note)) for t in self.trials)
        return dataclasses.replace(self, account=text(self.account), findings=findings, trials=trials)


PLAN_FORMAT_VERSION = 3  # 3: a plan is {config, evidence, provenance}; 2: one flat record
SOURCES = ("tuned", "cache")
DEVICES = ("cuda", "cpu")  # "cpu": the simulated ceiling


@dataclass(frozen=True, kw_only=True, slots=True)
class Provenance:
    """Where a plan comes from: its cache key, whether it was tuned now or read from the cache, and the device."""

    key: str = ""  # cache key, "" when the plan was never cached
    source: str = "tuned"
    device: str = "cuda"
    device_name: str = ""
    format_version: int = PLAN_FORMAT_VERSION

    def __post_init__(self) -> None:
        check_choice("Provenance.source", self.source, SOURCES)
        check_choice("Provenance.device", self.device, DEVICES)
        for name in ("key", "device_name"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"Provenance.{name} must be a string, got {getattr(self, name)!r}")
        check_non_negative_int("Provenance.format_version", self.format_version)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: Any) -> Provenance:
        d = dict_field("Plan.provenance", d)
        check_known_fields("Provenance", d, cls)
        return cls(**d)
