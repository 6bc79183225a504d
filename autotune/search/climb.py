"""Step: the climb over the anchor rungs. Decides which anchors are measured at all: each is explored in order
(`explore.py`), unless the time model of the best configuration so far says it cannot beat what was measured
(skipped, with a note), or an offloading anchor cannot beat its base by the base's time line
(`offload_bound.py`), or the trial budget is spent.

With a lattice to place, the climb runs twice around compile (`controller.py`): first the anchors that recompute
nothing, so compile's measured gain can bound the recompute anchors climbed after it."""

from __future__ import annotations

from collections.abc import Sequence

from ..configuration import Rung
from .explore import explore
from .ledger import Ledger
from .lines import NOISE, best_so_far, rung_state, upper_bound
from .offload_bound import cannot_win


def climb_all(s: Ledger) -> Ledger:
    """Step: climb every anchor lined up, in the order given."""
    climb(s, s.lined_up)
    return s


def climb_without_recompute(s: Ledger) -> Ledger:
    """Step: climb the anchors that recompute no block."""
    climb(s, [r for r in s.lined_up if r.checkpointed_blocks == 0])
    return s


def climb_with_recompute(s: Ledger) -> Ledger:
    """Step: climb the anchors that recompute blocks, bounded by everything measured before them."""
    climb(s, [r for r in s.lined_up if r.checkpointed_blocks != 0])
    return s


def climb(s: Ledger, rungs: Sequence[Rung]) -> None:
    """Explore each rung in order, unless the time model says it cannot beat the best measured."""
    previous = next((st for st in reversed(s.states) if st.ok), None)
    for rung in rungs:
        best = best_so_far(s)
        if best is not None:
            bound = upper_bound(s, rung, s.states)
            if bound is not None and bound <= best.samples_per_second * (1 + NOISE):
                s.notes.append(f"skipped {rung.name}: at best {bound:,.1f} samples/s, "
                               f"not above the {best.samples_per_second:,.1f} already measured")
                s.skipped.add(rung)
                continue
        beaten = cannot_win(s, rung)
        if beaten is not None:
            s.notes.append(beaten)
            s.skipped.add(rung)
            continue
        if len(s.trials) >= s.max_trials:
            s.notes.append(f"stopped before {rung.name}: trial budget ({s.max_trials}) spent")
            return
        state = rung_state(s, rung)
        explore(s, state, previous)
        if state.ok or previous is None:
            previous = state
