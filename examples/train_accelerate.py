"""Train a small GPT with a Hugging Face Accelerate loop: an ordinary Accelerate script, unaware of autotune.

Its knobs are its own flags (--batch_size, --gradient_accumulation_steps, --gradient_checkpointing,
--mixed_precision no|bf16), so `autotune run` tunes it in zero-change mode; bf16 is a flag with a
value, so its map carries a value template:

    autotune run --global-batch-size 32 --budget 40MiB \\
        --map micro_batch=--batch_size --map accumulation=--gradient_accumulation_steps \\
        --map checkpointing=--gradient_checkpointing --map bf16=--mixed_precision=bf16 \\
        examples/train_accelerate.py --max_steps 20

`accelerator.accumulate` steps the optimizer once per global batch; autotune counts those steps.
On its own: python examples/train_accelerate.py --batch_size 8 --gradient_accumulation_steps 4
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

try:
    from accelerate import Accelerator
except ImportError as exc:  # the examples must not break a machine without accelerate
    print(f"examples/train_accelerate.py needs accelerate: pip install accelerate ({exc})", file=sys.stderr)
    raise SystemExit(4) from None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt import GPT, CountingSequences, GPTConfig


class Checkpointed(nn.Module):
    """Recompute a block in backward instead of storing its activations."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch_size", type=int, default=8, help="samples per micro-batch")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--mixed_precision", choices=("no", "bf16", "fp16"), default="no")
    p.add_argument("--max_steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--logging_steps", type=int, default=5)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    accelerator = Accelerator(mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps)
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.width, seq_len=args.seq)
    model = GPT(cfg)
    if args.gradient_checkpointing:
        model.blocks = nn.ModuleList(Checkpointed(b) for b in model.blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    samples = args.max_steps * args.batch_size * args.gradient_accumulation_steps
    loader = torch.utils.data.DataLoader(CountingSequences(samples, cfg.seq_len, cfg.vocab_size),
                                         batch_size=args.batch_size, drop_last=True)
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    model.train()
    started, step = time.perf_counter(), 0
    for ids, labels in loader:
        with accelerator.accumulate(model):  # scales the loss and syncs/steps only at the last micro-batch
            loss = model(ids, labels)
            accelerator.backward(loss)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
        if accelerator.sync_gradients:
            step += 1
            if step % args.logging_steps == 0 or step == args.max_steps:
                rate = step * args.batch_size * args.gradient_accumulation_steps / (time.perf_counter() - started)
                accelerator.print(f"step {step:4d}  loss {loss.item():.4f}  {rate:,.1f} samples/s (wall clock)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
