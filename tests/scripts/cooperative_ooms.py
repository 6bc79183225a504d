"""A cooperative script whose real run runs out of memory in its first N launches, whatever the plan.

    cooperative_ooms.py LOG N

`autotune.fit` tunes a tiny MLP (storing its plan in the cache); launches 0 to N-1 then raise the OOM a
GPU would, so `autotune run` records each failure in the cache and restarts; the last launch trains a
few steps, whose measured rate the supervisor stores on the plan. Each launch appends
`restart_count micro_batch plan_key cache_inode supervisor_descriptors` to LOG, the last being how many
descriptors of the cache file the supervisor (this job's parent) holds open.
"""

import os
import sys
import time

import psutil
import torch
from torch import nn

import autotune

log_path, failing = sys.argv[1], int(sys.argv[2])
restart = int(os.environ["AUTOTUNE_RESTART_COUNT"])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
batch = (torch.randn(4, 32), torch.randn(4, 1))


def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # A fixed 10 ms a step, as a launch-bound GPU step pays: each doubling of the micro-batch then nearly doubles
    # the rate, far beyond what a busy CPU's noise can hide, so the first plan's micro-batch is the largest
    # (16) and three OOMs each halve it without reaching 1, after which there would be nothing to restart with.
    time.sleep(0.01)
    return nn.functional.mse_loss(m(b[0]), b[1])


plan = autotune.fit(model, batch, techniques=(), loss_fn=loss_fn)
cache = os.environ["AUTOTUNE_CACHE"]
held = sum(f.path == cache for f in psutil.Process(os.getppid()).open_files())
with open(log_path, "a") as log:
    log.write(f"{restart} {plan.micro_batch_size} {plan.key} {os.stat(cache).st_ino} {held}\n")
if restart < failing:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a longer batch than the trials saw)")
step = plan.apply(model, loss_fn=loss_fn)
for _ in range(3):
    step((torch.randn(plan.per_rank_batch_size, 32), torch.randn(plan.per_rank_batch_size, 1)))
print(f"finished with micro-batch {plan.micro_batch_size} x {plan.accumulation_steps}")
