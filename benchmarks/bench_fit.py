"""autotune.fit beside an exhaustive grid of the same rungs, on one GPU under a memory ceiling.

Each method runs in its own process (`--method`), so one's fragmentation cannot help or hurt another;
`--all` runs them one after another and prints a table. Results are JSON lines (`--out`).

    python benchmarks/bench_fit.py --all --out results.jsonl                 # GPT-2 large, 24 GiB
    python benchmarks/bench_fit.py --method train --steps 100 --out r.jsonl  # 100 steps at the plan
    python benchmarks/bench_fit.py --all --model tiny --device cpu --budget 40MiB   # a CPU dry run
    python benchmarks/bench_fit.py --method roof --steps 12 --out r.jsonl   # plain compiled bf16, no memory cap

Workload W1: GPT-2 large from a transformers config with random weights,
sequence 1024, AdamW, global batch 64, memory capped with torch.cuda.set_per_process_memory_fraction.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import GRID_MICRO, Spec, cap_memory, grid, trial_runner
from workloads import build_gpt as build

import autotune
from autotune.plan import Rung
from autotune.sizes import parse_bytes
from autotune.workload.losses import resolve


def run_fit(args: argparse.Namespace) -> dict[str, Any]:
    model, batch = build(args.model, args.device, args.seq)
    started = time.perf_counter()
    plan = autotune.fit(model, batch, global_batch_size=args.global_batch_size, memory_budget=args.budget,
                        device=args.device, cache=False)
    seconds = time.perf_counter() - started
    return {"method": "autotune", "tune_seconds": seconds, "trials": len(plan.trials),
            "ooms": sum(t.outcome == "oom" for t in plan.trials), "plan": plan.to_dict(),
            "config": [plan.rung.name, plan.micro_batch_size], "samples_per_second": plan.samples_per_second}


def run_grid(args: argparse.Namespace) -> dict[str, Any]:
    model, batch = build(args.model, args.device, args.seq)
    spec = Spec(name="bench_fit", title=args.model, model=args.model, budget=args.budget,
                global_batch_size=args.global_batch_size, seq=args.seq, device=args.device,
                trial_steps=args.grid_steps)
    runner, rungs = trial_runner(spec, model, batch, resolve(None), args.device)

    def show(trial: Any) -> None:
        print(f"grid {trial.rung.name:36} {trial.micro_batch_size:3d} {trial.outcome:11} "
              f"{trial.peak_bytes / 2**30:6.2f} GiB {trial.samples_per_second * args.seq:10.0f} tok/s", flush=True)

    started = time.perf_counter()
    trials = grid(runner, rungs, GRID_MICRO, args.global_batch_size, show).trials
    return {"method": "grid", "seconds": time.perf_counter() - started, "trials": [t.to_dict() for t in trials]}


def run_train(args: argparse.Namespace) -> dict[str, Any]:
    model, batch = build(args.model, args.device, args.seq)
    optimizer = torch.optim.AdamW(model.parameters())
    started = time.perf_counter()
    plan = autotune.fit(model, batch, global_batch_size=args.global_batch_size, memory_budget=args.budget,
                        device=args.device, cache=False, optimizer=optimizer)
    tune_seconds = time.perf_counter() - started
    step = plan.apply(model, optimizer)
    vocab = int(batch["input_ids"].max()) + 1
    losses, times = [], []
    for _ in range(args.steps):
        ids = torch.randint(0, vocab, (args.global_batch_size, args.seq), device=args.device)
        t0 = time.perf_counter()
        losses.append(step({"input_ids": ids, "labels": ids}))
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    phases: dict[str, float] = {}
    for t in plan.trials:
        for name, seconds in t.phases.items():
            phases[name] = round(phases.get(name, 0.0) + seconds, 1)
    return {"method": "train", "steps": args.steps, "tune_seconds": tune_seconds, "trials": len(plan.trials),
            "phase_totals": phases, "summary": plan.summary(), "plan": plan.to_dict(),
            "final_plan": step.plan.to_dict(),
            "recovered": step.plan.micro_batch_size != plan.micro_batch_size, "losses": losses,
            "median_step_seconds": steady, "samples_per_second": args.global_batch_size / steady,
            "peak_reserved": torch.cuda.max_memory_reserved() if args.device.startswith("cuda") else None}


def run_roof(args: argparse.Namespace) -> dict[str, Any]:
    """The roof a plan is held to: plain compiled bf16 (autocast, AdamW, torch.compile of the whole model) with no
    memory cap, `--roof-micro` samples a micro-batch, accumulated to the global batch; no autotune involved."""
    model, _ = build(args.model, args.device, args.seq)
    optimizer = torch.optim.AdamW(model.parameters())
    compiled = torch.compile(model)
    micro = args.roof_micro
    steps_per = max(1, args.global_batch_size // micro)
    vocab = model.config.vocab_size
    times, losses = [], []
    for _ in range(args.steps):
        ids = torch.randint(0, vocab, (steps_per, micro, args.seq), device=args.device)
        t0 = time.perf_counter()
        for m in range(steps_per):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(input_ids=ids[m], labels=ids[m]).loss / steps_per
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss) * steps_per)
    steady = sorted(times[2:])[len(times[2:]) // 2]
    return {"method": "roof", "micro_batch_size": micro, "accumulation_steps": steps_per, "steps": args.steps,
            "median_step_seconds": steady, "samples_per_second": micro * steps_per / steady, "losses": losses,
            "peak_reserved": torch.cuda.max_memory_reserved()}


def table(rows: list[dict[str, Any]], seq: int) -> None:
    grid = next((r for r in rows if r["method"] == "grid"), None)
    fit = next((r for r in rows if r["method"] == "autotune"), None)
    if grid:
        ok = [t for t in grid["trials"] if t["outcome"] == "ok"]
        best = max(ok, key=lambda t: t["samples_per_second"]) if ok else None
        if best:
            print(f"grid best: {Rung(**best['rung']).name} micro-batch {best['micro_batch_size']}: "
                  f"{best['samples_per_second'] * seq:,.0f} tok/s ({len(grid['trials'])} configs, "
                  f"{grid['seconds']:.0f} s)")
    if fit:
        plan = {**fit["plan"]["config"], **fit["plan"]["config"]["rung"]}  # the plan's configuration, flat
        print(f"autotune: {plan['precision']}/{plan['checkpointing']}/{plan['offload']} micro-batch "
              f"{plan['micro_batch_size']} x {plan['accumulation_steps']}: {fit['samples_per_second'] * seq:,.0f} "
              f"tok/s, {fit['trials']} trials, {fit['ooms']} OOMs, {fit['tune_seconds']:.1f} s")
        if grid and best:
            same = [t for t in grid["trials"] if t["rung"] == {k: plan[k] for k in ("precision", "checkpointing",
                    "offload")} and t["micro_batch_size"] == plan["micro_batch_size"]]
            if same:
                print(f"autotune's choice measured by the grid: {same[0]['samples_per_second'] * seq:,.0f} tok/s = "
                      f"{same[0]['samples_per_second'] / best['samples_per_second']:.3f}x the grid's best")
            print(f"autotune's own measure / grid best: {fit['samples_per_second'] / best['samples_per_second']:.3f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=("fit", "grid", "train", "roof"))
    p.add_argument("--roof-micro", type=int, default=8, help="--method roof: samples a micro-batch")
    p.add_argument("--all", action="store_true", help="grid, then fit, each in its own process")
    p.add_argument("--model", default="gpt2-large", choices=("gpt2-large", "gpt2-xl", "gpt2", "tiny"))
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--budget", default="24GiB")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--grid-steps", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", default="bench_fit.jsonl")
    args = p.parse_args()
    if args.all:
        for method in ("grid", "fit"):
            cmd = [sys.executable, __file__, "--method", method] + [a for a in sys.argv[1:] if a != "--all"]
            subprocess.run(cmd, check=True)
        with open(args.out) as f:
            table([json.loads(line) for line in f], args.seq)
        return 0
    if args.method != "roof":
        cap_memory(args.device, parse_bytes(args.budget))
    result = {"fit": run_fit, "grid": run_grid, "train": run_train, "roof": run_roof}[args.method](args)
    result.update(model=args.model, seq=args.seq, budget=args.budget, global_batch_size=args.global_batch_size,
                  device=torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
                  torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    with open(args.out, "a") as f:
        f.write(json.dumps(result) + "\n")
    if args.method == "train":
        print(f"train: tuned in {result['tune_seconds']:.1f} s ({result['trials']} trials, phases "
              f"{result['phase_totals']}); {result['summary']}; {args.steps} steps, recovered={result['recovered']}, "
              f"{result['samples_per_second'] * args.seq:,.0f} tok/s, "
              f"loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}")
    if args.method == "roof":
        print(f"roof: compiled bf16, micro-batch {result['micro_batch_size']} x {result['accumulation_steps']}, "
              f"{result['samples_per_second'] * args.seq:,.0f} tok/s, peak {result['peak_reserved'] / 2**30:.1f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
