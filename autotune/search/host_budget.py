"""The host budget in the search: configurations whose host memory is over it are never run.

Each rung's host need is computed before any trial (`techniques/host_need.py`: what optimizer offload
allocates there, and fit's copy of the model); a rung over `host_memory_budget` is left out with a note that
gives both figures, so a trial never allocates past the budget and the process is never left to the kernel's
OOM killer. An optimizer-offload rung whose whole optimizer would not fit the host is kept at the largest host
share that does (the rest stepped on the device, as a partial offload), so a model whose state fits neither
memory alone is split between them. When no rung fits the host, `NoFeasiblePlan` says it is the host. The plan
records the host memory its own configuration allocates (`plan.host_peak_bytes`), which `plan.apply` checks
against what is free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..configuration import Rung
from ..devices.shards import is_shard
from ..errors import NoFeasiblePlan
from ..evidence import Trial
from ..sizes import format_bytes, format_share
from ..techniques.host_need import HostNeed, offload_need, with_snapshot
from ..techniques.offload import overlap_default
from ..techniques.offload import partition as offload_partition
from ..techniques.offload.streamed import streams
from ..workload.optimizers import OptimizerSpec, state_tensors_per_parameter

MIN_HOST_SHARE = 0.05  # below this share the host saves the device too little to be worth its step
SHARE_STEPS = 12  # bisection steps for the largest share that fits: within 1/4096 of it
ADVICE = ("raise host_memory_budget (autotune run --host-budget), free host memory, or allow a rung that keeps "
          "the optimizer state on the device (more blocks recomputed, a smaller micro-batch, 8-bit state)")


def need(rung: Rung, model: nn.Module, spec: OptimizerSpec, device_type: str, *, fraction: float = 1.0,
         overlap: bool | None = None, snapshot: bool = True) -> HostNeed:
    """Host bytes of `rung` on `model`: its offload's buffers, with fit's copy of the model where `snapshot`.

    `overlap` as the plan's `offload_overlap` (None: what a trial does, which overlaps where it can)."""
    offload = HostNeed()
    if rung.offload == "optimizer":
        params = [p for p in model.parameters() if p.requires_grad]
        sharded = any(is_shard(p) for p in params)
        ranks = offload_partition.ranks(rung.precision, sharded)
        streamed = streams(device_type, spec.cls_name, rung.precision)
        overlapping = overlap_default() and overlap is not False and ranks == 1 and not sharded
        offload = offload_need(params, fraction=fraction, state_tensors=state_tensors_per_parameter(spec),
                               cuda=device_type == "cuda", streamed=streamed,
                               overlap=overlapping and (overlap is True or not streamed), ranks=ranks)
    return with_snapshot(offload, model) if snapshot else offload


def largest_share(rung: Rung, model: nn.Module, spec: OptimizerSpec, device_type: str,
                  limit_bytes: int, *, snapshot: bool = True) -> float | None:
    """The largest host share of `rung`'s offloaded optimizer (at least `MIN_HOST_SHARE`) whose host need fits
    `limit_bytes`; None when not even that share fits, or the rung offloads no optimizer."""
    if rung.offload != "optimizer":
        return None
    fits = lambda f: need(rung, model, spec, device_type, fraction=f, snapshot=snapshot).total <= limit_bytes  # noqa: E731
    if not fits(MIN_HOST_SHARE):
        return None
    low, high = MIN_HOST_SHARE, 1.0
    for _ in range(SHARE_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def keep_within(rungs: list[Rung], model: nn.Module, spec: OptimizerSpec, device_type: str,
                limit_bytes: int, *, snapshot: bool = True) -> tuple[list[Rung], list[str], dict[Rung, float]]:
    """The rungs whose host need fits `limit_bytes`, notes on those left out or capped with both figures, and
    the host share each capped optimizer-offload rung runs at (its whole optimizer would not fit the host).
    `snapshot`: fit's copy of the model is in RAM (not on disk: `host_need.snapshot_on_disk`).

    Raises:
        NoFeasiblePlan: no rung fits the host (the message names the host and each figure).
    """
    needs = {r: need(r, model, spec, device_type, snapshot=snapshot) for r in rungs}
    over = [r for r in rungs if needs[r].total > limit_bytes]
    caps = {r: share for r in over
            if (share := largest_share(r, model, spec, device_type, limit_bytes, snapshot=snapshot)) is not None}
    notes = [f"{r.name} at a host share of {format_share(share)}: its whole optimizer on the host would need "
             f"{format_bytes(needs[r].total)}, over the host budget of {format_bytes(limit_bytes)}"
             for r, share in caps.items()]
    over = [r for r in over if r not in caps]
    if not over:
        return list(rungs), notes, caps
    if len(over) == len(rungs):
        least = min(over, key=lambda r: needs[r].total)
        raise NoFeasiblePlan(f"nothing fits in host memory: the least any allowed configuration needs there is "
                             f"{format_bytes(needs[least].total)} ({least.name}: {needs[least].describe()}), over "
                             f"the host budget of {format_bytes(limit_bytes)}; {ADVICE}")
    least = min(over, key=lambda r: needs[r].total)
    names = ", ".join(sorted({r.name for r in over}))
    notes.append(f"{names} skipped: host memory {format_bytes(needs[least].total)} or more "
                 f"({needs[least].describe()}), over the host budget of {format_bytes(limit_bytes)}")
    return [r for r in rungs if r not in over], notes, caps


def pinned_bytes(model: nn.Module, spec: OptimizerSpec, device_type: str,
                 shares: dict[Rung, float]) -> Callable[[Rung, dict[str, Any]], int]:
    """The host bytes a trial's optimizer offload allocates before it runs, for the progress line."""
    def pinned(rung: Rung, kwargs: dict[str, Any]) -> int:
        if rung.offload != "optimizer":
            return 0
        fraction = kwargs.get("offload_fraction", shares.get(rung, 1.0))
        return need(rung, model, spec, device_type, fraction=fraction, snapshot=False).total

    return pinned


def at_shares(runner: Callable[..., Trial], shares: dict[Rung, float]) -> Callable[..., Trial]:
    """`runner`, with each rung in `shares` run at its host share unless the call names one: the search's
    trials of a rung whose whole optimizer would not fit the host measure it as it would train."""
    if not shares:
        return runner

    def run(rung: Rung, micro: int, **kw: Any) -> Trial:
        if rung in shares and "offload_fraction" not in kw:
            kw["offload_fraction"] = shares[rung]
        return runner(rung, micro, **kw)

    return run
