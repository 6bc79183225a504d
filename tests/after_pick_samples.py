"""What the steps after the pick run with in the search's scripted tests: a stand-in model on the CPU test
device, since a scripted runner makes up every trial and only the workload's arithmetic (batch, budgets, host
limit, world size) is read."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from autotune.devices.placement import resolve_device
from autotune.evidence import Trial
from autotune.search.controller import AfterPick
from autotune.search.trial import Workload
from autotune.workload.losses import resolve
from autotune.workload.optimizers import OptimizerSpec


def after_pick(run: Callable[..., Trial], *, per_rank: int, limit_bytes: int, budget_bytes: int | None = None,
               world_size: int = 1, host_limit: int | None = None, allowed: Iterable[str]) -> AfterPick:
    """An `AfterPick` over a two-layer stand-in; the budget defaults to the limit over the usual 0.9 margin."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    work = Workload(model=model, batch=torch.randn(4, 8), loss_fn=resolve(None),
                    spec=OptimizerSpec.from_user(None, model), placement=resolve_device("cpu"),
                    budget_bytes=budget_bytes or int(limit_bytes / 0.9), limit_bytes=limit_bytes, per_rank=per_rank,
                    world_size=world_size, host_limit_bytes=host_limit)
    return AfterPick(run=run, work=work, sharded=False, allowed=frozenset(allowed))
