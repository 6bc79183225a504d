"""Train a small GPT with a plain PyTorch loop that takes its knobs as Hugging Face-style flags.

The script knows nothing of autotune. `autotune run` tunes it through its own flags (zero-change mode),
then runs it with the winning ones:

    autotune run --global-batch-size 32 --budget 40MiB \\
        --map micro_batch=--per_device_train_batch_size --map accumulation=--gradient_accumulation_steps \\
        --map checkpointing=--gradient_checkpointing --map bf16=--bf16 \\
        examples/train_zero_change.py --max_steps 20

On its own: python examples/train_zero_change.py --per_device_train_batch_size 8 --gradient_accumulation_steps 4
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt import GPT, GPTConfig


class Checkpointed(nn.Module):
    """Recompute a block in backward instead of storing its activations."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def pattern_batch(cfg: GPTConfig, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count up from a random start by a random stride: learnable, so the loss falls."""
    start = torch.randint(0, cfg.vocab_size, (n, 1), generator=generator)
    stride = torch.randint(1, 4, (n, 1), generator=generator)
    ids = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--max_steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--logging_steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.width, seq_len=args.seq)
    model = GPT(cfg)
    if args.gradient_checkpointing:
        model.blocks = nn.ModuleList(Checkpointed(b) for b in model.blocks)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    generator = torch.Generator().manual_seed(args.seed + 1)
    print(f"training on {device}: micro-batch {micro} x {accumulation} accumulation = {micro * accumulation} "
          f"samples/step, checkpointing {'on' if args.gradient_checkpointing else 'off'}, "
          f"{'bf16' if args.bf16 else 'fp32'}", flush=True)
    started = time.perf_counter()
    for step in range(1, args.max_steps + 1):
        total = 0.0
        for _ in range(accumulation):
            ids, labels = (t.to(device) for t in pattern_batch(cfg, micro, generator))
            with torch.autocast(device_type=device, dtype=dtype, enabled=args.bf16):
                loss = model(ids, labels) / accumulation  # scale the loss to account for gradient accumulation
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.logging_steps == 0 or step == args.max_steps:
            rate = step * micro * accumulation / (time.perf_counter() - started)
            print(f"step {step:4d}  loss {total:.4f}  {rate:,.1f} samples/s (wall clock)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
