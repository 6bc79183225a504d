"""The lattice search on W1 beside an expert grid that includes compile, on one GPU.

Methods, each in a process of its own (`--method`), JSON lines to `--out`:
    fit    autotune.fit on W1 (compile allowed), then `--steps` global steps through `plan.apply`;
           run it twice with the same TORCHINDUCTOR_CACHE_DIR for the cold and the warm compile cache
    grid   compile off/on x blocks recomputed {0, N/2, N} x offload {none, optimizer}, 2-3 micro-batches
           each, measured with autotune's own trial runner; then the grid's best trained `--steps` steps
           through `plan.apply`, as the plan is
    train  `--steps` steps of a given configuration (`--config k,offload,compile,micro`)

    TORCHINDUCTOR_CACHE_DIR=/tmp/ind python benchmarks/bench_lattice.py --method fit --steps 20 --out w1.jsonl
    python benchmarks/bench_lattice.py --method grid --steps 20 --out w1.jsonl
    python benchmarks/bench_lattice.py --method fit --model tiny --device cpu --budget 40MiB --steps 2 --out x.jsonl

W1: GPT-2 large from a transformers config (random weights), sequence 1024, AdamW, global batch 64,
memory capped at 24 GiB with torch.cuda.set_per_process_memory_fraction.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import build_gpt as build
from workloads import cap_memory, environment

import autotune
from autotune.devices.placement import now, resolve_device
from autotune.plan import Plan, Rung
from autotune.search.trial import TrialRunner, Workload
from autotune.sizes import parse_bytes
from autotune.techniques import find_blocks
from autotune.workload import batch as batches
from autotune.workload.batching import solve_accumulation
from autotune.workload.losses import resolve
from autotune.workload.optimizers import OptimizerSpec


def run_fit(args: argparse.Namespace) -> dict[str, Any]:
    model, batch = build(args.model, args.device, args.seq)
    started = time.perf_counter()
    plan = autotune.fit(model, batch, global_batch_size=args.global_batch_size, memory_budget=args.budget,
                        device=args.device, cache=False)
    seconds = time.perf_counter() - started
    print(f"fit: {plan.summary()} in {seconds:.1f} s ({plan.compile_seconds:.1f} s compiling), "
          f"{len(plan.trials)} trials\n  {plan.reason}", flush=True)
    for t in plan.trials:
        print(f"  {t.rung.name:44} {t.micro_batch_size:3d} {t.outcome:11} {t.peak_bytes / 2**30:6.2f} GiB "
              f"{t.samples_per_second * args.seq:9.0f} tok/s  compile {t.compile_seconds:5.1f} s  {t.note[:60]}",
              flush=True)
    record = {"method": "autotune", "tune_seconds": seconds, "trials": len(plan.trials),
              "ooms": sum(t.outcome == "oom" for t in plan.trials), "plan": plan.to_dict(),
              "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")}
    if args.steps:
        record["train"] = train(plan, model, batch, args)
    return record


def run_grid(args: argparse.Namespace) -> dict[str, Any]:
    model, batch = build(args.model, args.device, args.seq)
    placement = resolve_device(args.device)
    budget = parse_bytes(args.budget)
    blocks = find_blocks(model)
    n = len(blocks.blocks)
    work = Workload(model=model, batch=batch, loss_fn=resolve(None), spec=OptimizerSpec.from_user(None, model),
                    placement=placement, budget_bytes=budget, limit_bytes=int(0.9 * budget),
                    per_rank=args.global_batch_size, blocks=blocks, measured_steps=3)
    runner = TrialRunner(work)
    trials = []
    started = time.perf_counter()
    for compiled in (False, True):
        for k in (0, n // 2, n):
            for offload in ("none", "optimizer"):
                rung = _rung(k, n, offload, compiled)
                fitted = 0
                for micro in ((2, 4, 8, 16) if k == 0 else (4, 8, 16, 32)):
                    trial = runner(rung, micro)
                    trials.append(trial)
                    print(f"grid {rung.name:44} {micro:3d} {trial.outcome:11} {trial.peak_bytes / 2**30:6.2f} GiB "
                          f"{trial.samples_per_second * args.seq:9.0f} tok/s  compile {trial.compile_seconds:5.1f} s",
                          flush=True)
                    fitted += trial.fits
                    if not trial.fits or fitted == 3:
                        break
    record: dict[str, Any] = {"method": "grid", "seconds": time.perf_counter() - started,
                              "trials": [t.to_dict() for t in trials]}
    ok = [t for t in trials if t.fits]
    if ok and args.steps:
        best = max(ok, key=lambda t: t.samples_per_second)
        plan = _plan(best.rung, best.micro_batch_size, args, budget)
        record["best"] = {"rung": best.rung.name, "micro_batch_size": best.micro_batch_size,
                          "trial_samples_per_second": best.samples_per_second}
        record["train"] = train(plan, model, batch, args)
    return record


def run_train(args: argparse.Namespace) -> dict[str, Any]:
    model, batch = build(args.model, args.device, args.seq)
    k, offload, compiled, micro = args.config.split(",")
    n = len(find_blocks(model).blocks)
    plan = _plan(_rung(int(k), n, offload, compiled == "1"), int(micro), args, parse_bytes(args.budget))
    return {"method": "train", "config": args.config, "train": train(plan, model, batch, args)}


def train(plan: Plan, model: torch.nn.Module, batch: Any, args: argparse.Namespace) -> dict[str, Any]:
    """`args.steps` optimizer steps through `plan.apply`; tok/s from the third step on (the first two
    build the optimizer state and compile)."""
    placement = resolve_device(args.device)
    data = batches.resize(batch, plan.global_batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = plan.apply(model, optimizer)
    times, losses = [], []
    if not placement.simulated:
        torch.cuda.reset_peak_memory_stats(placement.index)
    try:
        for _ in range(args.steps):
            t0 = now(placement)
            losses.append(float(step(data)))
            times.append(now(placement) - t0)
    finally:
        recoveries = len(step.recoveries)
        step.close()
    steady = times[2:] or times
    seconds = statistics.median(steady)
    peak = torch.cuda.max_memory_reserved(placement.index) if not placement.simulated else 0
    result = {"config": plan.summary(), "steps": len(times), "median_step_seconds": seconds,
              "tokens_per_second": plan.global_batch_size * args.seq / seconds, "first_step_seconds": times[0],
              "peak_reserved_bytes": peak, "recoveries": recoveries, "loss_first": losses[0], "loss_last": losses[-1]}
    print(f"train {plan.rung.name} @ {plan.micro_batch_size}: {result['tokens_per_second']:,.0f} tok/s over "
          f"{len(steady)} steps, peak {peak / 2**30:.2f} GiB, {recoveries} recoveries", flush=True)
    return result


def _rung(k: int, n: int, offload: str, compiled: bool) -> Rung:
    label = "none" if k == 0 else "full" if k == n else "selective"
    return Rung(precision="bf16", checkpointing=label, checkpointed_blocks=k, offload=offload, compile=compiled)


def _plan(rung: Rung, micro: int, args: argparse.Namespace, budget: int) -> Plan:
    steps, last = solve_accumulation(args.global_batch_size, micro)
    return Plan.of(precision=rung.precision, checkpointing=rung.checkpointing,
                checkpointed_blocks=rung.checkpointed_blocks, offload=rung.offload, compile=rung.compile,
                micro_batch_size=micro, accumulation_steps=steps,
                world_size=1, global_batch_size=args.global_batch_size, last_micro_batch_size=last,
                peak_memory_bytes=0, memory_budget_bytes=budget, margin=0.1, samples_per_second=0.0,
                device="cpu" if args.device == "cpu" else "cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=("fit", "grid", "train"), required=True)
    parser.add_argument("--model", default="gpt2-large")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget", default="24GiB")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--config", default="0,optimizer,1,8", help="train: blocks,offload,compile(0/1),micro")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logging.getLogger("autotune").setLevel(logging.INFO)  # each trial as it ends: a cut-off run still tells
    cap_memory(args.device, args.budget)
    record = {"run": {"fit": run_fit, "grid": run_grid, "train": run_train}[args.method](args),
              "workload": {"model": args.model, "seq": args.seq, "global_batch_size": args.global_batch_size,
                           "budget": args.budget}, "environment": environment(args.device)}
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
