"""The configurations the search measures first: the anchors of the lattice, with their 8-bit and fp8 twins
when allowed, and the techniques a model is tuned with (a float64 model keeps float64)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from torch import nn

from ..configuration import RECOMPUTE_POLICIES, WHOLE_BLOCK, Rung
from ..devices.placement import Placement
from ..techniques import fp8, optimizer_8bit
from ..techniques.blocks import BlockGroup
from ..techniques.ladder import is_float64, ladder
from ..techniques.names import parse_techniques
from ..techniques.sharding import is_sharded
from ..workload.optimizers import OptimizerSpec


def keep_dtype(allowed: frozenset[str], model: nn.Module, given: Iterable[str] | str | None) -> frozenset[str]:
    """The techniques `model` is tuned with: a float64 model keeps float64, so "bf16" is dropped unless `given`
    (the techniques the user named: fit's `techniques`, else $AUTOTUNE_TECHNIQUES) names it. The default set,
    which holds "bf16" for the usual float32 model, does not count as asking for it. A float32 model asks
    for float32 the same way: by a `techniques` without "bf16"."""
    if "bf16" not in allowed or not is_float64(model) or (given is not None and "bf16" in parse_techniques(given)):
        return allowed
    return allowed - {"bf16"}


def anchors(allowed: frozenset[str], placement: Placement, blocks: BlockGroup | None, *,
            float64: bool = False) -> tuple[list[Rung], list[str]]:
    """The eager configurations the search measures first, in the order it tries them (`float64`: see `ladder`).

    Every offload is tried with no block and with every block recomputed: these corners give the bytes
    per sample with and without recompute and the resident floor with and without optimizer offload,
    from which the search predicts the rest of the lattice (intermediate block counts, compile). Every block
    recomputed is tried too with each selective `recompute_policy` (matmuls' and attention's outputs kept),
    between none and the whole blocks, where `allowed` names 'selective_recompute': it frees less than
    whole-block recompute for less time.
    """
    rungs, notes = ladder(allowed, placement, blocks, float64=float64)
    n = len(blocks.blocks) if blocks is not None else 0
    plain = [r for r in rungs if r.offload == "none" and r.checkpointed_blocks in (0, n)]
    # Opt-in ('selective_recompute'): eager, torch's selective checkpoint costs more in dispatch than the recompute
    # it saves on a GPU's transformer blocks, and under compile a policy is refused, so by default its trials
    # would only lengthen the tune.
    kept = [dataclasses.replace(r, recompute_policy=p) for r in plain[1:] for p in RECOMPUTE_POLICIES
            if p != WHOLE_BLOCK and "selective_recompute" in allowed]  # most kept first: the least freed
    plain = plain[:1] + kept + plain[1:]
    optimizer = [r for r in rungs if r.offload == "optimizer"]
    bare = [dataclasses.replace(r, checkpointing="none", checkpointed_blocks=0) for r in optimizer if n][:1]
    # Optimizer offload without recompute (its floor, none of the recompute) before activation offload.
    order = plain + bare + [r for r in rungs if r.offload == "activations"] + optimizer
    if n and "saved_activations" in allowed and placement.kind == "cuda":
        # Saved-activation offload without recompute, beside the recomputing one: only where a side stream can
        # hide its copies behind compute (on the CPU device they are plain copies, in the step's time). Opt-in:
        # the copies hide only where a block's compute outlasts moving its saved bytes over the host link.
        order.append(dataclasses.replace(rungs[0], checkpointing="none", checkpointed_blocks=0,
                                         offload="saved_activations"))
    return list(dict.fromkeys(order)), notes


def eight_bit_anchors(rungs: list[Rung], allowed: frozenset[str], spec: OptimizerSpec,
                      device_type: str) -> tuple[list[Rung], list[str]]:
    """When 'optimizer_8bit' is allowed, the anchors plus an 8-bit twin of each anchor stepped on the device,
    tried last: 8-bit state is what the user accepts when nothing lighter fits, not a first choice.
    The missing package is an error here, before any trial (see `optimizer_8bit.require`)."""
    if "optimizer_8bit" not in allowed:
        return rungs, []
    if not optimizer_8bit.supports(spec):
        return rungs, [f"optimizer_8bit skipped: only Adam and AdamW have an 8-bit form, not {spec.cls_name}"]
    optimizer_8bit.require(device_type)
    twins = [dataclasses.replace(r, optimizer_8bit=True) for r in rungs
             if r.offload != "optimizer" and not r.compile and r.recompute_policy == WHOLE_BLOCK]
    return rungs + twins, []


def fp8_anchors(rungs: list[Rung], allowed: frozenset[str], placement: Placement,
                model: nn.Module) -> tuple[list[Rung], list[str]]:
    """When 'fp8' is allowed and the device has float8 matmuls, the anchors plus an fp8 twin of each bf16 anchor,
    so each is measured with and without it. Left out with a note where the device has none or no linear layer
    is servable; torchao missing is an error here, before any trial (see `fp8.require`)."""
    if "fp8" not in allowed:
        return rungs, []
    why = fp8.unavailable(placement)
    if why is not None:
        return rungs, [why]
    if is_sharded(model):  # torchao casts FSDP2's shards through its own all-gather, not set up here
        return rungs, ["fp8 left out under FSDP2 sharding: it is searched on replicated ranks"]
    chosen = fp8.layers(model)
    twins = [dataclasses.replace(r, fp8=True) for r in rungs
             if r.precision == "bf16" and r.recompute_policy == WHOLE_BLOCK]
    if not chosen.converted or not twins:
        return rungs, [chosen.note() if twins else "fp8 left out: it runs beside bf16, which is not allowed here"]
    fp8.require()
    chosen = fp8.served(model)  # a torchao that cannot serve Conv1D layers leaves them in bf16
    return (rungs + twins, [chosen.note()]) if chosen.converted else (rungs, [chosen.note()])
