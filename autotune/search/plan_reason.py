"""The plan's reason, as typed findings composed once from the `Ledger` when every step has run: the account of
the pick (`Ledger.head`), what the steps after it found (`Ledger.findings`), why micro-batch 1 was skipped, the
first notes, the decisions every trial ran under, and the noise clause. `evidence.render` writes the text."""

from __future__ import annotations

from ..evidence import Finding, render
from .ledger import Ledger
from .trial import noise_note


def account(s: Ledger) -> str:
    """The pick and what the steps after it found, in the order they found it."""
    return render(s.head, s.findings)


def findings(s: Ledger, notes: list[str], *, first: str = "", last: tuple[str, ...] = ()) -> tuple[Finding, ...]:
    """What the reason says after the account of the pick, in order: the steps' findings, why micro-batch 1 was
    skipped, the first two of `notes` not already said, `first` (a decision that changed what every trial ran on,
    said before everything), `last`, and the noise clause; never cut."""
    floor = [s.floor_note] if s.floor_note else []
    said = {f.clause for f in s.findings}  # a step's finding is said already: never twice
    rest = [n for n in notes if n not in floor and n not in said]
    out = [*s.findings, *(Finding(kind="note", clause=n) for n in [*floor, *rest][:2 + len(floor)])]
    if first:
        out.append(Finding(kind="note", clause=first, place="before"))
    out.extend(Finding(kind="note", clause=c) for c in last if c)
    noise = noise_note(s.trials)
    if noise:
        out.append(Finding(kind="noise", clause=noise, figures={"noisy_trials": sum(t.fits and t.noisy
                                                                                   for t in s.trials)}))
    return tuple(out)


def reason(s: Ledger, notes: list[str], *, first: str = "", last: tuple[str, ...] = ()) -> str:
    """The plan's reason as `findings` renders it after the account of the pick."""
    return render(s.head, findings(s, notes, first=first, last=last))
