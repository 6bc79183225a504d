"""Where a training step's time goes: GPU busy time against wall time, the CPU's heaviest operators, and
every point where the host waits for the device (the fixed cost per micro-batch).

A hand-built plan (as `bench_offload.py --config`) trains `--warmup` steps, then one step under
`torch.cuda.set_sync_debug_mode("warn")` (each synchronizing call's stack, counted), then `--steps` steps
under `torch.profiler`. Printed: wall time per step, the device's kernel time in it, the idle share, the
top CPU operators by self time, the synchronizing calls by where they come from.

    python benchmarks/profile_step.py --workload W1 --config 0,7,0.89 --compile --out prof.json
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
import traceback
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_offload import config_parser, set_up
from workloads import environment

from autotune.workload import batch as batches


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sync_points(step: Any, batch: Any) -> list[tuple[str, int]]:
    """Run one step with synchronizing CUDA calls reported; (where, count) by count, most first."""
    counts: collections.Counter[str] = collections.Counter()
    if not torch.cuda.is_available():
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        original = warnings.showwarning
        try:
            def remember(message: Any, *rest: Any) -> None:
                frames = [f for f in traceback.extract_stack()[:-2] if "site-packages/torch/" not in f.filename]
                where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[-3:][::-1])
                counts[f"{str(message)[:60]} @ {where}"] += 1
            warnings.showwarning = remember
            step(batch)
            sync()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = original
    return counts.most_common(15)


def profiled(step: Any, batch: Any, steps: int) -> dict[str, Any]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step(batch)
        sync()
        wall = (time.perf_counter() - started) / steps
    events = prof.key_averages()
    device_time = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
                      for e in events) / 1e6 / steps
    cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)[:20]
    return {"wall_s": wall, "device_busy_s": device_time, "idle_share": max(0.0, 1 - device_time / wall),
            "cpu_top": [(e.key, e.count // steps, e.self_cpu_time_total / 1e6 / steps) for e in cpu]}


def main() -> None:
    args = config_parser(__doc__, workload="W1", config="0,7,0.89", steps=2, warmup=3).parse_args()
    setup = set_up(args)
    seq, global_batch, device = setup.seq, setup.global_batch, setup.device
    batch = batches.resize(setup.example, global_batch)
    plan = setup.plan(args)
    step = plan.apply(setup.model)
    try:
        for _ in range(args.warmup):
            step(batch)
        syncs = sync_points(step, batch)
        prof = profiled(step, batch, args.steps)
    finally:
        step.close()
    micro_steps = plan.accumulation_steps
    print(f"{args.workload} {plan.rung.name} {plan.micro_batch_size} x {micro_steps}: step {prof['wall_s']:.3f} s, "
          f"device busy {prof['device_busy_s']:.3f} s, idle {prof['idle_share']:.1%}, "
          f"{global_batch * seq / prof['wall_s']:,.0f} tok/s", flush=True)
    print("synchronizing calls in one step:")
    for where, n in syncs:
        print(f"  {n:4d}  {where[:230]}")
    print("CPU self time per step (top 20):")
    for key, count, seconds in prof["cpu_top"]:
        print(f"  {seconds * 1e3:8.1f} ms  {count:6d} calls  {key[:90]}")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"workload": args.workload, "plan": plan.rung.name, "micro": plan.micro_batch_size,
                                "syncs": syncs, **prof, **environment(device)}) + "\n")


if __name__ == "__main__":
    main()
