"""`Trial`: one measured configuration, the evidence a plan is chosen from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .configuration import Rung
from .validate import check_choice, check_known_fields, check_non_negative_int, check_non_negative_number, \
    check_positive_int, dict_field

NOISY = "noisy timings"  # how a noisy trial's note says so (the plan's reason counts the `noisy` ones)
OUTCOMES = ("ok", "oom", "over_budget", "error")  # error: compile failed; the search goes on eager


@dataclass(frozen=True, kw_only=True, slots=True)
class Trial:
    """One measured trial: a rung at a micro-batch size, and what happened."""

    rung: Rung
    micro_batch_size: int
    outcome: str  # "ok" | "oom" | "over_budget" (ran, but its peak left less than the margin)
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
    noisy: bool = False  # its step times spread wide (on this rank or another): the plan's reason counts these
    overlapped: bool = False  # its measured steps overlapped the host optimizer with the last backward
    note: str = ""  # for people: what happened, in words; decisions read the fields above

    def __post_init__(self) -> None:
        if not isinstance(self.rung, Rung):
            raise ValueError(f"Trial.rung must be a Rung, got {type(self.rung).__name__}")
        check_positive_int("Trial.micro_batch_size", self.micro_batch_size)
        check_choice("Trial.outcome", self.outcome, OUTCOMES)
        for name in ("peak_bytes", "alloc_retries"):
            check_non_negative_int(f"Trial.{name}", getattr(self, name))
        for name in ("seconds", "step_seconds", "optimizer_seconds", "samples_per_second", "compile_seconds",
                     "reduce_seconds", "reduce_after_seconds"):
            check_non_negative_number(f"Trial.{name}", getattr(self, name))
        for name in ("noisy", "overlapped"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Trial.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def fits(self) -> bool:
        return self.outcome == "ok"

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["rung"] = dataclasses.asdict(self.rung)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trial:
        check_known_fields("Trial", d, cls)
        d = dict(d)
        d["rung"] = Rung(**dict_field("Trial.rung", d.get("rung")))
        return cls(**d)
