"""Recovery from an OOM in training: the policy (what failed -> the next configuration) and who is told.

The policy is pure: given the plan in force and the rungs recovery may climb, it returns the next plan
(half the micro-batch, or at the smallest micro-batch the next rung up), or None past the top. Training
never writes to the plan cache itself: `autotune.fit` keeps a callback with the plan it returns
(`plan.learned.report`, training/learned.py), and the step calls it after each recovery as
`callback(old_plan, new_plan, note, shapes)` (`new_plan` None: nothing fits, or the optimizer step ran
out of memory). A plan without one (built by hand, read from the cache or JSON) records nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from .. import parallel
from ..configuration import CHECKPOINTING, OFFLOAD, RECOMPUTE_POLICIES, Rung, state_sharded
from ..devices.placement import Placement
from ..evidence import Finding, Trial
from ..settings import FitSettings
from ..sizes import format_bytes
from ..techniques import block_count, is_float64, ladder, parse_techniques, serve_dtypes
from ..workload import batch as batches
from ..workload.batching import smallest_micro_batch, solve_accumulation

if TYPE_CHECKING:  # plan.py sits above training/ and imports it
    from ..plan import Plan

log = logging.getLogger(__name__)



@dataclass(frozen=True, kw_only=True, slots=True)
class Recovery:
    """One OOM met in training, and what the step did about it."""

    step: int  # index of the optimizer step (calls to `step(batch)`) it happened in, from 0
    failed: str  # the configuration that ran out of memory, e.g. "bf16 at micro-batch 8"
    micro_step: int  # which micro-batch of the batch (from 0) ran out of memory; -1 when another rank did
    now: str  # the configuration the batch is re-run with
    shapes: dict[str, list[int]]  # each tensor's shape in the micro-batch that failed, e.g. {"[0]": [8, 4096]}
    seconds: float  # wall time of the failed attempt and its clean-up: the time lost
    note: str  # the error's first line


# -- who is told -------------------------------------------------------------------------------------------

def report(old: Plan, new: Plan | None, shapes: dict[str, list[int]], note: str) -> None:
    """Tell the callback `fit` kept with `old` (`old.learned.report`), on the writing rank only; whatever it does,
    training goes on."""
    callback = old.learned.report
    if callback is None or not parallel.is_writer():
        return
    try:
        callback(old, new, note[:200], shapes)
    except Exception as exc:  # noqa: BLE001 - recording must never break training
        log.warning("autotune: could not record the OOM in the plan cache (%s); training goes on", exc)


# -- the policy --------------------------------------------------------------------------------------------

def revised(plan: Plan, finding: Finding | None, **knobs: Any) -> Plan:
    """`plan` with some knobs changed and `finding` (why) added to its reason: the one place the step builds a
    plan (`Plan.with_config`; a Plan is read by its methods here, since plan.py sits above training)."""
    changed = plan.with_config(**knobs)
    return changed if finding is None else changed.with_finding(finding)


def counted(plan: Plan, blocks: Any) -> Plan:
    """`plan` with its label's default block count as a number, which recovery compares (`block_count`: it
    refuses a plan that checkpoints a model without repeated blocks). Where the model's library checkpoints
    its own blocks the count stays unset: autotune recomputes none of them."""
    count = block_count(plan.rung, blocks)
    if plan.checkpointed_blocks is not None or (blocks is not None and blocks.library):
        return plan
    return revised(plan, None, checkpointed_blocks=count)


def host_share(plan: Plan) -> float:
    """The host's share of `plan`'s offloaded optimizer, as `apply_rung` takes it (1.0 where none is offloaded)."""
    return plan.offload_fraction if plan.offload == "optimizer" else 1.0


def at(plan: Plan, rung: Rung, micro: int, why: Finding, *, smallest: int | None = None) -> Plan:
    """`plan` on `rung` at micro-batch `micro`, accumulation solved again for the same per-rank batch, its reason
    now `why` (placed instead of the search's account). A rung that offloads leaves the sharded optimizer state
    (the configuration allows it no offload); under optimizer offload the engine partitions what it keeps on the
    device."""
    smallest = plan.min_micro_batch_size if smallest is None else smallest
    steps, last = solve_accumulation(plan.per_rank_batch_size, micro, smallest)
    sharding = "none" if plan.partitioned_state and rung.offload != "none" else plan.sharding
    return revised(plan, why, sharding=sharding, precision=rung.precision, checkpointing=rung.checkpointing,
                   checkpointed_blocks=rung.checkpointed_blocks, recompute_policy=rung.recompute_policy,
                   compile=rung.compile, optimizer_8bit=rung.optimizer_8bit, fp8=rung.fp8, offload=rung.offload,
                   offload_fraction=plan.offload_fraction if rung == plan.rung else None,
                   micro_batch_size=min(micro, plan.per_rank_batch_size), accumulation_steps=steps,
                   last_micro_batch_size=last, min_micro_batch_size=smallest)


def after_oom(plan: Plan, rungs: list[Rung]) -> Plan | None:
    """The next plan after an OOM: half the micro-batch, else the next rung up at the smallest; None past the top."""
    lowest = smallest_micro_batch(plan.per_rank_batch_size, plan.min_micro_batch_size) or 1
    if plan.micro_batch_size > lowest:
        micro = max(plan.micro_batch_size // 2, lowest)
        return at(plan, plan.rung, micro, Finding(
            kind="recovered", place="instead", figures={"failed_micro_batch_size": plan.micro_batch_size,
                                                        "micro_batch_size": micro},
            clause=f"recovered from an OOM in training at micro-batch {plan.micro_batch_size}: halved to {micro}"))
    rung = next_rung(rungs, plan.rung)
    if rung is None:
        return None
    return at(plan, rung, lowest, Finding(
        kind="recovered", place="instead", subject=rung.name,
        figures={"failed_micro_batch_size": lowest, "micro_batch_size": lowest},
        clause=f"recovered from an OOM in training at micro-batch {lowest} on {plan.rung.name}: moved up to "
               f"{rung.name}"))


def balanced(plan: Plan, failure: str) -> Plan:
    """After batch statistics failed on a 1-sample micro-batch: every micro-batch holds 2 samples or more."""
    micro = max(plan.micro_batch_size, smallest_micro_batch(plan.per_rank_batch_size, 2) or 1)
    return at(plan, plan.rung, micro, Finding(
        kind="balanced", place="instead", subject=failure, figures={"micro_batch_size": micro},
        clause=f"{failure} on a 1-sample micro-batch (batch statistics): every micro-batch now holds 2 samples "
               "or more, the split balanced"), smallest=2)


def grown(plan: Plan, cap: int, clean_steps: int) -> Plan:
    """The micro-batch doubled back (at most `cap`) after `clean_steps` clean steps."""
    bigger = min(2 * plan.micro_batch_size, cap)
    return at(plan, plan.rung, bigger, Finding(
        kind="grown", place="instead", figures={"micro_batch_size": bigger, "clean_steps": clean_steps},
        clause=f"grown back to micro-batch {bigger} after {clean_steps} clean steps"))


def next_rung(rungs: list[Rung], current: Rung) -> Rung | None:
    """The cheapest allowed rung that keeps every technique in force and adds one."""
    for rung in rungs:
        if _strength(rung) != _strength(current) and _dominates(rung, current):
            return rung
    return None


def _strength(rung: Rung) -> tuple[int, int, int, int]:
    # The count breaks ties between two "selective" rungs; None (the label's default) counts as the label. Blocks
    # keeping their matmuls free less than whole blocks: "whole_block", first of the policies, is the strongest.
    policy = len(RECOMPUTE_POLICIES) - RECOMPUTE_POLICIES.index(rung.recompute_policy)
    return (OFFLOAD.index(rung.offload), CHECKPOINTING.index(rung.checkpointing), rung.checkpointed_blocks or 0,
            policy)


def _dominates(a: Rung, b: Rung) -> bool:
    """`a` is at least as strong as `b` in checkpointing and in offload: recovery climbs the ladder's
    order but never trades checkpointing away for offload (when the allowed techniques would)."""
    return all(x >= y for x, y in zip(_strength(a), _strength(b)))


def allowed(plan: Plan, techniques: Any) -> frozenset[str]:
    """The step's `techniques`, else what fit was allowed (`plan.techniques`), else $AUTOTUNE_TECHNIQUES or all."""
    if techniques is None and plan.techniques is not None:
        techniques = plan.techniques  # what fit was allowed: recovery never climbs past it
    return parse_techniques(FitSettings.resolve(techniques=techniques).techniques)


def climbable_rungs(plan: Plan, techniques: Any, placement: Placement, blocks: Any, model: nn.Module) -> list[Rung]:
    """The ladder recovery may climb, in the plan's precision (recovery never changes the numerics)."""
    names = set(allowed(plan, techniques))
    if plan.precision == "fp32":
        names.discard("bf16")  # and optimizer offload with it, but for float64 weights (see `ladder`)
    else:
        names.add("bf16")
    rungs, _ = ladder(frozenset(names), placement, blocks, compile=plan.compile,  # compile stays as tuned
                      float64=is_float64(model))
    # An 8-bit plan keeps its 8-bit state (recovery never changes the numerics) and so never climbs to
    # optimizer offload, whose host optimizer keeps FP32 state.
    # fp8 stays as tuned too: recovery frees memory, it does not change the numerics.
    rungs = [dataclasses.replace(r, precision=plan.precision, optimizer_8bit=plan.optimizer_8bit, fp8=plan.fp8)
             for r in rungs
             if not (plan.optimizer_8bit and r.offload == "optimizer")]
    rungs, _ = serve_dtypes(rungs, model)
    return rungs


# -- what is said about it -----------------------------------------------------------------------------------

def describe(plan: Plan) -> str:
    partitioned = f", {state_sharded()}" if plan.partitioned_state else ""
    return f"{plan.rung.name}{partitioned} at micro-batch {plan.micro_batch_size}"


def micro_batch_shapes(batch: Any, micro: int) -> dict[str, list[int]]:
    """{tensor path: shape} of a micro-batch of `micro` samples of `batch`: what the cache records."""
    return {path or "batch": [micro, *shape] for path, shape, _ in batches.signature(batch)}


def exhausted(failed: list[Trial], shapes: dict[str, list[int]], plan: Plan) -> str:
    tried = ", ".join(f"{t.rung.name} at micro-batch {t.micro_batch_size}" for t in failed)
    shape = "; ".join(f"{path} {tuple(s)}" for path, s in shapes.items())
    return (f"a micro-batch of [{shape}] does not fit in the memory budget of "
            f"{format_bytes(plan.memory_budget_bytes)}: out of memory at {tried}, and no higher rung is "
            "allowed. Shorten the inputs, raise memory_budget, or allow more techniques "
            "(techniques=('bf16', 'checkpointing', 'offload')).")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
