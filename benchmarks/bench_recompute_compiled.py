"""Recomputed blocks under compile, whole against keeping their matmuls: hand-written plans trained side by side.

Each configuration trains the same model from the same weights on the same batches through `plan.apply`, in a
process of its own (a configuration that runs out of memory leaves nothing behind for the next), under the
workload's memory cap. Reported per configuration: tokens/s over the steps after the first two (the first
compiles, the second compiles the plan's shape static), the first step's seconds, the peak reserved, the last
loss (the same batches: the losses agree where the arithmetic does).

    python benchmarks/bench_recompute_compiled.py --configs 17:whole_block:16:1,36:save_matmuls:8:1 --steps 10
    python benchmarks/bench_recompute_compiled.py --model tiny --budget 4GiB --global-batch-size 8 --seq 64 \\
        --device cpu --configs 2:save_matmuls:4:0 --steps 3                                 # CPU smoke run

`--configs` lists BLOCKS:POLICY:MICRO:SHARE, comma-separated: blocks recomputed, what a recomputed block keeps
(`recompute_policy`), the micro-batch, and the optimizer's share stepped on the host (0: no offload).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import build_gpt, cap_memory

from autotune.plan import Plan
from autotune.sizes import parse_bytes
from autotune.workload.batching import solve_accumulation


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-large")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--budget", default="24GiB")
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--configs", default="17:whole_block:16:1,36:save_matmuls:8:1,36:save_half_matmuls:8:1")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one configuration, in this process
    p.add_argument("--out", default=None, help="a JSON-lines file to append each configuration's row to")
    return p.parse_args()


def plan_for(config: str, args: argparse.Namespace) -> Plan:
    blocks, policy, micro, share = config.split(":")
    steps, last = solve_accumulation(args.global_batch_size, int(micro))
    offload = float(share) > 0
    return Plan.of(precision="bf16", checkpointing="none" if int(blocks) == 0 else "selective",
                   checkpointed_blocks=int(blocks), recompute_policy=policy, compile=args.device == "cuda",
                   offload="optimizer" if offload else "none", offload_fraction=float(share) if offload else None,
                   micro_batch_size=int(micro), accumulation_steps=steps, global_batch_size=args.global_batch_size,
                   last_micro_batch_size=last, memory_budget_bytes=parse_bytes(args.budget),
                   techniques=("bf16", "checkpointing", "offload", "compile", "chunked_loss", "selective_recompute"),
                   device="cuda" if args.device == "cuda" else "cpu")


def train_one(args: argparse.Namespace) -> dict[str, object]:
    cap_memory(args.device, args.budget)
    model, _ = build_gpt(args.model, args.device, args.seq)
    vocab = model.config.vocab_size if hasattr(model, "config") else 128
    plan = plan_for(args.one, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    times, losses = [], []
    row: dict[str, object] = {"config": args.one, "plan": plan.summary() if hasattr(plan, "summary") else str(plan)}
    try:
        with plan.apply(model, optimizer) as step:
            for _ in range(args.steps):
                ids = torch.randint(0, vocab, (args.global_batch_size, args.seq), generator=generator)
                ids = ids.to(args.device)
                started = time.perf_counter()
                losses.append(float(step({"input_ids": ids, "labels": ids})))
                if args.device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - started)
    except torch.OutOfMemoryError as exc:
        row["error"] = f"out of memory: {str(exc)[:160]}"
    measured = times[2:]
    tokens = args.global_batch_size * args.seq
    row.update(first_step_s=round(times[0], 2) if times else None, steps=len(times), losses=losses,
               tokens_per_s=round(tokens * len(measured) / sum(measured)) if measured else None,
               step_s=[round(t, 3) for t in times],
               reserved_peak_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2) if args.device == "cuda" else None)
    return row


def main() -> None:
    args = parse()
    if args.one is not None:
        print("ROW " + json.dumps(train_one(args)), flush=True)
        return
    rows = []
    for config in args.configs.split(","):
        argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--one", config]
        done = subprocess.run(argv, capture_output=True, text=True)
        found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
        row = json.loads(found[-1]) if found else {"config": config, "error": done.stderr[-600:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(f"{'config':32} {'tok/s':>8} {'first s':>8} {'peak GiB':>9} {'last loss':>10}")
    for row in rows:
        loss = row.get("losses") or [None]
        print(f"{row['config']:32} {row.get('tokens_per_s') or '-':>8} {row.get('first_step_s') or '-':>8} "
              f"{row.get('reserved_peak_gib') or '-':>9} {loss[-1] if loss[-1] is not None else '-':>10} "
              f"{row.get('error', '')[:80]}")


if __name__ == "__main__":
    main()
