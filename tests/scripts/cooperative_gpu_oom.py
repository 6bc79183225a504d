"""A cooperative GPU script whose first real run dies of a real CUDA out-of-memory error.

It tunes a small GPT with `autotune.fit` as a user's script would (the global batch, budget and cache come
from `autotune run`), trains two steps, and on its first launch then asks the device for more memory than it
has, as a neighbour taking the card or a longer batch than the trials saw would. `autotune run` must record
the failure and restart it; the second launch trains to the end. Each launch appends
`restart micro_batch accumulation source` to the file named by argv[1].
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from gpt import GPT, GPTConfig, random_batch

import autotune

log_path = sys.argv[1]
restart = int(os.environ["AUTOTUNE_RESTART_COUNT"])
torch.manual_seed(0)
cfg = GPTConfig(vocab_size=512, n_layer=4, n_embd=256, n_head=4, seq_len=256)
model = GPT(cfg).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
plan = autotune.fit(model, tuple(t.cuda() for t in random_batch(cfg, 8)), optimizer=optimizer)
with open(log_path, "a") as log:
    log.write(f"{restart} {plan.micro_batch_size} {plan.accumulation_steps} {plan.source}\n")
step = plan.apply(model, optimizer)
generator = torch.Generator().manual_seed(1)
for _ in range(2):
    step(tuple(t.cuda() for t in random_batch(cfg, plan.per_rank_batch_size, generator)))
if restart == 0:
    torch.empty(2 * torch.cuda.get_device_properties(0).total_memory, dtype=torch.uint8, device="cuda")
print(f"finished with micro-batch {plan.micro_batch_size} x {plan.accumulation_steps}")
