"""A zero-change script (Hugging Face-style flags, no autotune) whose memory grows with the batch size.

Each sample carries (256, 256) activations (256 KiB each in fp32, a few live in backward), so under a
small simulated ceiling the larger micro-batches run out of memory for real. A fixed sleep per
micro-step makes larger micro-batches faster per sample, as kernel launches do on a GPU. The final arguments are printed
(to stdout) and written to argv[1].
"""

import argparse
import time

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--per_device_train_batch_size", type=int, default=64)
p.add_argument("--gradient_accumulation_steps", type=int, default=1)
p.add_argument("--max_steps", type=int, default=3)
args = p.parse_args()

torch.manual_seed(0)
# Elementwise only: memory grows with the batch, compute hardly does, so the fixed per-step cost decides.
weight = nn.Parameter(torch.randn(256, 256) * 0.01)
optimizer = torch.optim.SGD([weight], lr=0.01)
for _ in range(args.max_steps):
    for _micro in range(args.gradient_accumulation_steps):
        x = torch.randn(args.per_device_train_batch_size, 256, 256)
        loss = torch.tanh(x * weight).pow(2).mean() / args.gradient_accumulation_steps
        loss.backward()
        time.sleep(0.05)  # per micro-step overhead: larger micro-batches are faster per sample
    optimizer.step()
    optimizer.zero_grad()
line = f"batch={args.per_device_train_batch_size} accumulation={args.gradient_accumulation_steps}"
print(f"FINAL {line}")
with open(args.out, "w") as f:
    f.write(line)
