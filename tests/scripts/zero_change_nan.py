"""A zero-change script (Hugging Face-style flags, no autotune) whose data holds a NaN, so every step's loss is NaN.

It prints `step N  loss nan` after each optimizer step, as examples/train_zero_change.py prints its loss.
"""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--per_device_train_batch_size", type=int, default=2)
p.add_argument("--gradient_accumulation_steps", type=int, default=1)
p.add_argument("--max_steps", type=int, default=3)
args = p.parse_args()

torch.manual_seed(0)
weight = nn.Parameter(torch.randn(8, 8) * 0.1)
optimizer = torch.optim.SGD([weight], lr=0.01)
for step in range(1, args.max_steps + 1):
    total = 0.0
    for _ in range(args.gradient_accumulation_steps):
        x = torch.randn(args.per_device_train_batch_size, 8)
        x[0, 0] = float("nan")  # one bad sample in every batch
        loss = (x @ weight).pow(2).mean() / args.gradient_accumulation_steps
        loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step:4d}  loss {total:.4f}", flush=True)
