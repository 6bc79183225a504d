"""Step: intermediate block counts. Decides how many of the N repeated blocks to recompute, per offload: the
fewest that let a faster micro-batch fit, predicted from the bytes per sample measured with none and with all
blocks recomputed (whole blocks, or keeping their matmuls under each `recompute_policy`), then verified by a
trial (`placement.try_best`)."""

from __future__ import annotations

from ..configuration import RECOMPUTE_POLICIES, WHOLE_BLOCK
from .ledger import Ledger
from .placement import candidates_for, try_best


def place_blocks(s: Ledger) -> Ledger:
    """Per offload, the fewest recomputed blocks that let a faster micro-batch fit, predicted from the
    bytes per sample measured with none and with all blocks recomputed, then verified; whole blocks
    recomputed or keeping their matmuls (each `recompute_policy` measured with all blocks), whichever
    is predicted fastest."""
    n = s.lattice.blocks
    if n < 2:
        return s
    for offload in ("none", "optimizer"):
        if not any(st.rung.offload == offload and not st.rung.compile for st in s.states):
            continue
        # (all blocks keeping their matmuls is an anchor without offload only)
        candidates = [c for policy in RECOMPUTE_POLICIES for c in candidates_for(s, offload, None, policy=policy)
                      if 0 < (c[0].checkpointed_blocks or 0) < n
                      or (c[0].checkpointed_blocks == n and c[0].recompute_policy != WHOLE_BLOCK)]
        try_best(s, candidates, f"{offload} offload, blocks recomputed")
    return s
