"""The plan's reason, composed once from the `Ledger` when every step has run: the account of the pick
(`Ledger.head`), what the steps after it found (`Ledger.findings`), why micro-batch 1 was skipped, the first
notes, and the noise clause."""

from __future__ import annotations

from .ledger import Ledger
from .trial import noise_note


def account(s: Ledger) -> str:
    """The pick and what the steps after it found, in the order they found it."""
    text = s.head
    for f in s.findings:
        text = f"{f.clause}; then: {text}" if f.leads else f"{text}; {f.clause}"
    return text


def reason(s: Ledger, notes: list[str], *, first: str = "", last: tuple[str, ...] = ()) -> str:
    """The plan's reason: `first` (a decision that changed what every trial ran on), the account of the pick,
    why micro-batch 1 was skipped, the first two of `notes` not already in the account, then `last` and the
    noise clause, never cut."""
    floor = [s.floor_note] if s.floor_note else []
    said = {f.clause for f in s.findings}  # a step's finding is in the account already: never twice
    rest = [n for n in notes if n not in floor and n not in said]
    text = account(s) + "".join(f"; {n}" for n in [*floor, *rest][:2 + len(floor)])
    if first:
        text = f"{first}; {text}"
    for clause in (*last, noise_note(s.trials)):
        if clause:
            text += f"; {clause}"
    return text
