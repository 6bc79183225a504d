"""Which sharding a plan takes, by measurement: replicated or FSDP2 on several ranks, and on several nodes
hybrid sharding beside flat FSDP2; where one may win, both are searched and the faster measured plan kept.

Flat FSDP2 shards every parameter over all ranks, so each block's all-gathers and reduce-scatters cross the link
between nodes, several times a step. Hybrid sharding (torchtitan's and Megatron's HSDP) shards within a node and
replicates across nodes: its gathers stay on the node's own links and only one all-reduce of each shard's
gradients crosses nodes, for twice the memory per rank of the parameters' shards. Which wins depends on that
link, so it is measured: the two searches' trials ran over it, and the all-reduce across nodes is timed on its
own for the plan's reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

from .. import parallel as distributed
from ..errors import DeviceError, NoFeasiblePlan
from ..evidence import Finding
from ..parallel.topology import cross_node_seconds, hybrid_mesh
from ..plan import Plan
from ..sizes import format_bytes
from ..techniques.sharding import is_sharded
from .lines import NOISE

log = logging.getLogger(__name__)

_REDUCE_BYTES = 4  # FSDP2 reduces gradients in FP32 (`MixedPrecisionPolicy(reduce_dtype=float32)`)


def sharding_may_win(plan: Plan, model: nn.Module, world: int) -> bool:
    """Whether a sharded search could beat replicated `plan`: on two or more ranks, for a model not sharded
    already, where the replicated plan spends time on memory (blocks recomputed, something offloaded)."""
    if world < 2 or is_sharded(model) or plan.sharding != "none":
        return False
    return plan.checkpointing != "none" or plan.offload != "none"


def replicated_or_sharded(replicated: Plan, sharded: Plan) -> Plan:
    """The faster of the two measured plans, replicated on a tie (within `NOISE`), the other's figure said."""
    faster = sharded.samples_per_second > (1 + NOISE) * replicated.samples_per_second
    kept, other = (sharded, replicated) if faster else (replicated, sharded)
    ratio = kept.samples_per_second / max(other.samples_per_second, 1e-12)
    how = "sharded with FSDP2" if faster else "replicated"
    note = (f"{how}: {kept.samples_per_second:,.1f} samples/s, {ratio:.2f}x the "
            f"{'replicated' if faster else 'sharded'} plan's {other.samples_per_second:,.1f} ({other.summary()})")
    return kept.with_finding(Finding(kind="sharding", clause=note, subject=how, place="before", figures={
        "samples_per_second": kept.samples_per_second, "ratio": ratio,
        "other_samples_per_second": other.samples_per_second}))


def hybrid_may_win(flat: Plan, model: nn.Module) -> bool:
    """Whether a hybrid-sharded search could beat `flat`: an FSDP2 plan fit sharded itself, on two or more nodes."""
    return flat.sharding == "fsdp2" and flat.config.nodes > 1 and not is_sharded(model)


def searched_beside(plan: Plan, what: str, search: Callable[[], Plan]) -> tuple[Plan | None, Plan]:
    """The plan a second search (`what`: another placement) finds beside `plan`, and `plan`; or None and `plan`
    with why in its reason, where nothing fits there or every configuration failed (`plan` stands)."""
    try:
        return search(), plan
    except NoFeasiblePlan:
        return None, plan.with_finding(Finding(kind="nothing fits", clause=f"{what}: nothing fits", subject=what))
    except DeviceError:
        raise
    except Exception as exc:  # noqa: BLE001 - every configuration of the second search failed: `plan` stands
        first = (str(exc).strip().splitlines() or [""])[0]
        return None, plan.with_finding(Finding(kind="search failed", clause=f"{what}: {type(exc).__name__}: {first}",
                                               subject=what))


def with_hybrid(flat: Plan, model: nn.Module, search: Callable[[], Plan]) -> Plan:
    """`flat`, or the hybrid-sharded plan `search()` finds where it measured faster (`flat_or_hybrid`)."""
    if not hybrid_may_win(flat, model):
        return flat
    hybrid, flat = searched_beside(flat, "hybrid sharding", search)
    if hybrid is None:
        return flat
    shard_bytes = _REDUCE_BYTES * sum(p.numel() for p in model.parameters()) * flat.config.nodes // flat.world_size
    mesh = hybrid_mesh(flat.config.nodes, distributed.collective_device().type)
    return flat_or_hybrid(flat, hybrid, link_seconds=cross_node_seconds(mesh, shard_bytes), shard_bytes=shard_bytes)


def flat_or_hybrid(flat: Plan, hybrid: Plan, *, link_seconds: float, shard_bytes: int) -> Plan:
    """The faster of the two measured plans, flat on a tie (within `NOISE`: fewer bytes per rank), with a reason
    that names both rates and the all-reduce across nodes as measured."""
    faster = hybrid.samples_per_second > (1 + NOISE) * flat.samples_per_second
    kept, other = (hybrid, flat) if faster else (flat, hybrid)
    ratio = kept.samples_per_second / max(other.samples_per_second, 1e-12)
    per_node = flat.world_size // flat.config.nodes
    hybrid_name = f"hybrid sharding (over the {per_node} ranks of each of {flat.config.nodes} nodes, replicated across)"
    flat_name = f"flat FSDP2 (over all {flat.world_size} ranks, every gather across nodes)"
    how, against = (hybrid_name, "flat") if faster else (flat_name, "hybrid")
    note = (f"{how}: {kept.samples_per_second:,.1f} samples/s, {ratio:.2f}x the {against} plan's "
            f"{other.samples_per_second:,.1f}; the all-reduce of a rank's {format_bytes(shard_bytes)} gradient shard "
            f"across nodes measured {1000 * link_seconds:,.1f} ms")
    log.info("autotune: %s", note)
    return kept.with_finding(Finding(kind="hybrid", clause=note, subject="hybrid" if faster else "flat",
                                     place="before", figures={
                                         "samples_per_second": kept.samples_per_second, "ratio": ratio,
                                         "other_samples_per_second": other.samples_per_second,
                                         "link_seconds": link_seconds, "shard_bytes": shard_bytes}))
