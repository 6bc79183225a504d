"""What a recomputed block keeps: the whole block recomputed, or its expensive operators' outputs kept.

`recompute_policy` "whole_block" (the default) keeps nothing inside a recomputed block: backward runs its whole
forward again. The selective policies keep the outputs of the block's expensive operators and recompute only
the cheap ones (norms, activations, dropout, elementwise), through torch's selective activation checkpointing
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`, the non-reentrant checkpoint's `context_fn`):

- "save_matmuls": every matmul (`aten.mm`, `addmm`, `bmm`, `baddbmm`: what `nn.Linear` and `torch.matmul` run)
  and every attention kernel (`aten._scaled_dot_product_*_attention`) is kept; the recompute costs a few
  elementwise passes, and a block keeps most of what it would without recompute but its norms' and
  activations' intermediates.
- "save_half_matmuls": attention is kept, and every other matmul (the first, third...: in a transformer
  block the query projection and the MLP's up projection are kept, the key and down projections recomputed);
  it frees more than "save_matmuls" for half the matmuls' work again.

Random operators (dropout's) are never kept: they run again in the recompute, and the checkpoint restores the
RNG state the forward drew them from, so their masks are the forward's. A policy decides per operator call in
the block's forward, in call order, so the forward and its recompute keep the same calls; what the recompute
runs besides the block's forward (its buffers put back, activation offload's input brought back) runs `aside`,
where torch's selective checkpoint, which refuses an operator its forward did not run, does not see it.
A block that changes a kept output in place (an in-place activation right after a `Linear`) cannot keep it:
torch raises in backward ("Tensor cached during selective activation checkpoint has been mutated"), and the
search records that trial as failed and goes on without the policy.

Under compile a recomputed block is compiled inside its checkpoint (`compile.py`), where the selective
checkpoint sees only the compiled graph's out-of-place library calls (`aten.addmm.out` into the graph's own
buffers), not the block's operators: the selective policies do not compose with it, and a configuration asking
for both is refused (`Rung` raises `InvalidSetting`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..configuration import RECOMPUTE_POLICIES, WHOLE_BLOCK
from ..torch_private import in_selective_recompute, innermost_mode_aside

SELECTIVE = RECOMPUTE_POLICIES[1:]

_aten = torch.ops.aten
MATMULS = frozenset(getattr(_aten, name).default for name in ("mm", "addmm", "bmm", "baddbmm"))
ATTENTION = frozenset(
    getattr(_aten, name).default for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable")
    if hasattr(_aten, name))


def context_fn(policy: str) -> Callable[[], Any] | None:
    """The non-reentrant checkpoint's `context_fn` for `policy`; None for "whole_block" (torch's default: keep
    nothing). Each call of the returned function gives a checkpoint its own pair of contexts, with its own
    count of matmuls."""
    if policy == WHOLE_BLOCK:
        return None
    if policy not in SELECTIVE:
        raise ValueError(f"recompute_policy must be one of {', '.join(RECOMPUTE_POLICIES)}; got {policy!r}")
    every_matmul = policy == "save_matmuls"

    def contexts() -> Any:
        counts = {False: 0, True: 0}  # matmuls seen, in the forward and in the recompute apart

        def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if func in ATTENTION:
                return CheckpointPolicy.MUST_SAVE
            if func in MATMULS:
                counts[ctx.is_recompute] += 1
                if every_matmul or counts[ctx.is_recompute] % 2 == 1:
                    return CheckpointPolicy.MUST_SAVE
            # everything else, random operators included, runs again under the forward's RNG state
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(decide)

    return contexts




@contextlib.contextmanager
def aside() -> Iterator[None]:
    """Operators run here, inside a selective checkpoint's recompute, bypass it: only that mode is set aside (an
    outer one, as the simulated ceiling counting bytes, still sees them). Anywhere else it does nothing."""
    if not in_selective_recompute():
        yield
        return
    with innermost_mode_aside():
        yield
