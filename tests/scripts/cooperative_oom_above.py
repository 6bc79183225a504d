"""A cooperative script whose real run runs out of memory at every micro-batch above a limit, whatever the launch.

    cooperative_oom_above.py LOG LIMIT

`autotune.fit` tunes a tiny MLP (its trials see no limit); the "real run" then raises the OOM a GPU would
(a longer batch than the trials saw, say) when the plan's micro-batch is above LIMIT, and else trains a step.
Each launch appends `restart_count micro_batch plan_key` to LOG.
"""

import os
import sys

import torch
from torch import nn

import autotune

log_path, limit = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
batch = (torch.randn(4, 32), torch.randn(4, 1))
loss_fn = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
plan = autotune.fit(model, batch, techniques=(), loss_fn=loss_fn)
with open(log_path, "a") as log:
    log.write(f"{os.environ['AUTOTUNE_RESTART_COUNT']} {plan.micro_batch_size} {plan.key}\n")
if plan.micro_batch_size > limit:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a longer batch than the trials saw)")
step = plan.apply(model, loss_fn=loss_fn)
step((torch.randn(plan.per_rank_batch_size, 32), torch.randn(plan.per_rank_batch_size, 1)))
print(f"finished with micro-batch {plan.micro_batch_size} x {plan.accumulation_steps}")
