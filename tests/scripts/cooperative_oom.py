"""A cooperative script whose real run runs out of memory at the micro-batch of its first plan.

`autotune.fit` tunes a tiny MLP under the simulated ceiling; the "real run" then raises the OOM a GPU
would (a longer sequence than the trials saw, say) whenever the plan's micro-batch is at least the one
the first attempt got. So the run only finishes if `autotune run` restarts it with a smaller plan.
Each launch appends `restart_count micro_batch` to the file named by argv[1].
"""

import os
import sys

import torch
from torch import nn

import autotune

log_path = sys.argv[1]
restart = int(os.environ["AUTOTUNE_RESTART_COUNT"])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
batch = (torch.randn(4, 32), torch.randn(4, 1))
plan = autotune.fit(model, batch, techniques=(),
                    loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
with open(log_path, "a") as log:
    log.write(f"{restart} {plan.micro_batch_size} {plan.accumulation_steps}\n")
with open(log_path) as log:
    first_micro = int(log.readline().split()[1])
if plan.micro_batch_size >= first_micro:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a longer batch than the trials saw)")
print(f"finished with micro-batch {plan.micro_batch_size} x {plan.accumulation_steps}")
