"""Train a small GPT with a plan from `autotune.fit`.

On a GPU it tunes under the card's free memory (or --budget); without one it runs the same search on
the CPU under a simulated memory ceiling, and says so.

    python examples/fit_gpt.py                 # defaults: 6 layers, seq 128, global batch 32
    python examples/fit_gpt.py --budget 40MiB --steps 20
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt import GPT, GPTConfig, random_batch

import autotune

CPU_BUDGET = "40MiB"  # small enough that this model needs checkpointing or offload on the CPU


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--budget", default=None, help=f"memory budget, e.g. 24GiB (CPU default: {CPU_BUDGET})")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to train after tuning")
    parser.add_argument("--cache", default=None, help="plan cache path (default: the user cache); 'off' to skip")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    budget = args.budget
    if device == "cpu":
        budget = budget or CPU_BUDGET
        print(f"No CUDA GPU found: running on the CPU under a simulated memory ceiling of {budget} "
              "(the real search, with a byte budget standing in for GPU memory).")
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.width, seq_len=args.seq)
    model = GPT(cfg).to(device)
    example = tuple(t.to(device) for t in random_batch(cfg, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    cache = False if args.cache == "off" else args.cache
    plan = autotune.fit(model, example, global_batch_size=args.global_batch_size, optimizer=optimizer,
                        memory_budget=budget, device=device, cache=cache)
    print()
    print(f"{'rung':40} {'micro':>5} {'outcome':>11} {'peak MiB':>9} {'samples/s':>10}")
    for t in plan.trials:
        print(f"{t.rung.name:40} {t.micro_batch_size:5d} {t.outcome:>11} {t.peak_bytes / 2**20:9.1f} "
              f"{t.samples_per_second:10.1f}")
    print(f"\nplan ({plan.source}): {plan.summary()}\nwhy: {plan.reason}\n")

    step = plan.apply(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    started = time.perf_counter()
    for i in range(args.steps):
        batch = tuple(t.to(device) for t in random_batch(cfg, args.global_batch_size, generator))
        loss = step(batch)
        print(f"step {i + 1:3d}  loss {loss:.4f}")
    seconds = time.perf_counter() - started
    print(f"\ntrained {args.steps} steps in {seconds:.1f} s "
          f"({args.steps * args.global_batch_size / seconds:.1f} samples/s) with {step.plan.summary()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
