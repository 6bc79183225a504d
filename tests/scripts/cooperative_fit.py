"""A cooperative job for the fault tests: calls `autotune.fit` with what `autotune run` passes, then trains.

    cooperative_fit.py LOG [--width N] [--fit JSON] [--distributed]

LOG gets one line per launch: "launch RESTART_COUNT WORLD". --fit adds keyword arguments to fit (as JSON);
--distributed initialises torch.distributed (gloo) first, as a torchrun script would.
"""

import argparse
import json
import os

import torch
from torch import nn

import autotune

parser = argparse.ArgumentParser()
parser.add_argument("log")
parser.add_argument("--width", type=int, default=16)
parser.add_argument("--fit", default="{}")
parser.add_argument("--distributed", action="store_true")
args = parser.parse_args()
if args.distributed:
    torch.distributed.init_process_group("gloo")
with open(f"{args.log}.{os.environ.get('RANK', '0')}", "a") as log:
    log.write(f"launch {os.environ.get('AUTOTUNE_RESTART_COUNT')} {os.environ.get('WORLD_SIZE', '1')}\n")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 1))
batch = torch.randn(4, args.width)
plan = autotune.fit(model, batch, loss_fn=lambda m, b: m(b).pow(2).mean(), **json.loads(args.fit))
step = plan.apply(model, loss_fn=lambda m, b: m(b).pow(2).mean())
step(torch.randn(plan.per_rank_batch_size, args.width))
print(f"trained: {plan.summary()}", flush=True)
if args.distributed:
    torch.distributed.destroy_process_group()
