"""`SearchState`: what the search knows after the controller picked, which the phases after it refine (the
pick, its offload share and overlaps, every trial run), and what they found; the plan's reason is composed
once from it (`reason`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..evidence import Trial
from .controller import SearchResult
from .trial import noise_note


@dataclass(frozen=True, kw_only=True)
class Finding:
    """What one phase found that the plan's reason says: a clause after the account of the pick, or, where the
    phase replaced the pick, one before it (`leads`: "clause; then: ...")."""

    phase: str
    clause: str
    leads: bool = False


@dataclass(kw_only=True)
class SearchState:
    """The pick and the evidence, as the phases leave them."""

    best: Trial
    trials: list[Trial]
    notes: list[str]  # why configurations were left out or not tried, in the order they were found
    head: str  # the controller's account of its pick
    smallest: int = 1  # the fewest samples a micro-batch may hold
    floor_note: str = ""  # why micro-batch 1 was skipped, or ""
    fraction: float | None = None  # `plan.offload_fraction`; None: the whole optimizer or none offloaded
    overlap: bool | None = None  # `plan.offload_overlap`
    reduce_overlap: bool | None = None  # `plan.reduce_overlap`
    findings: list[Finding] = field(default_factory=list)
    cut: bool = False  # max_tune_seconds stopped the search or the phases after it (`deadline.OutOfTime`)
    untried: int = 0  # configurations the search lined up and neither measured nor ruled out

    @classmethod
    def of(cls, result: SearchResult) -> SearchState:
        """The state the controller's `result` starts the phases from (its trial and note lists shared)."""
        return cls(best=result.best, trials=result.trials, notes=result.notes, head=result.reason,
                   smallest=result.smallest, floor_note=result.floor_note, cut=result.cut)

    def found(self, phase: str, clause: str, *, leads: bool = False) -> None:
        self.findings.append(Finding(phase=phase, clause=clause, leads=leads))

    def account(self) -> str:
        """The pick and what the phases found, in the order they found it."""
        text = self.head
        for f in self.findings:
            text = f"{f.clause}; then: {text}" if f.leads else f"{text}; {f.clause}"
        return text


def reason(state: SearchState, notes: list[str], *, first: str = "", last: tuple[str, ...] = ()) -> str:
    """The plan's reason: `first` (a decision that changed what every trial ran on), the account of the pick,
    why micro-batch 1 was skipped, the first two of `notes` not already in the account, then `last` and the
    noise clause, never cut."""
    floor = [state.floor_note] if state.floor_note else []
    said = {f.clause for f in state.findings}  # a phase's finding is in the account already: never twice
    rest = [n for n in notes if n not in floor and n not in said]
    text = state.account() + "".join(f"; {n}" for n in [*floor, *rest][:2 + len(floor)])
    if first:
        text = f"{first}; {text}"
    for clause in (*last, noise_note(state.trials)):
        if clause:
            text += f"; {clause}"
    return text
