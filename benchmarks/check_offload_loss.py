"""Does a plan train the same losses as the plan without optimizer offload? Per step, from one initial model.

    python benchmarks/check_offload_loss.py --model gpt2-medium --steps 6 \
        --variants 0@6,0.65@6,0.65@8,0.65@6@eager,0.65@6@serial,1@6

Each variant is SHARE@MICRO[@eager][@serial][@full]: the host share of optimizer offload (0: none), the
micro-batch (the global batch split into micro-batches of it, the last one what is left), eager instead of
compiled blocks, the serial offload step instead of the overlapped one, the model's own (unchunked) loss.
Every variant starts from the same weights and sees the same batches; it prints each step's loss and how
many parameters hold a non-finite value after the step. A JSON line per variant goes to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import build_gpt

from autotune.plan import Plan
from autotune.techniques.offload import HostOptimizer, StreamedEngine
from autotune.training.step import TrainingStep
from autotune.workload.batching import solve_accumulation


def variant_plan(variant: str, global_batch: int, device: str) -> tuple[Plan, bool]:
    share, micro, *flags = variant.split("@")
    steps, last = solve_accumulation(global_batch, int(micro))
    plan = Plan.of(precision="bf16", checkpointing="none", offload="optimizer" if float(share) > 0 else "none",
                offload_fraction=float(share), micro_batch_size=int(micro), accumulation_steps=steps, world_size=1,
                global_batch_size=global_batch, last_micro_batch_size=last, peak_memory_bytes=0,
                memory_budget_bytes=2**40, margin=0.1, samples_per_second=0.0, device=device,
                compile="eager" not in flags, offload_overlap="serial" not in flags)
    return plan, "full" in flags


def run(args: argparse.Namespace, variant: str) -> dict:
    plan, full = variant_plan(variant, args.global_batch_size, args.device)
    model, _ = build_gpt(args.model, args.device, args.seq)
    techniques = ("bf16", "offload", "compile") if full else None
    step = TrainingStep(plan, model, torch.optim.AdamW(model.parameters(), lr=1e-5), techniques=techniques)
    g = torch.Generator().manual_seed(7)
    losses, bad, times = [], [], []
    for _ in range(args.steps):
        ids = torch.randint(0, 50257, (args.global_batch_size, args.seq), generator=g).to(args.device)
        t0 = time.perf_counter()
        losses.append(step({"input_ids": ids, "labels": ids}))
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        bad.append(sum(int((~torch.isfinite(p)).any()) for p in model.parameters()))
        if len(bad) == 1:
            where = _where(step, model)
    step.close()
    return {"variant": variant, "losses": losses, "nonfinite_parameters": bad, "step_seconds": times, **where,
            "loss_fn": step.loss_fn.__name__, "recoveries": len(step.recoveries)}


def _where(step: TrainingStep, model: torch.nn.Module) -> dict:
    """After the first step: which parameters (by position) are non-finite, and which share each is in."""
    params = list(model.parameters())
    bad = [i for i, p in enumerate(params) if not torch.isfinite(p).all()]
    host = getattr(step._applied, "optimizer", None)
    out = {"first_nonfinite": bad[:12]}
    if isinstance(host, HostOptimizer):
        device_index = host.shares.device_index
        streamed_index = host.shares.host_index if isinstance(host, StreamedEngine) else []
        out["nonfinite_in_device_share"] = len(set(bad) & set(device_index))
        out["nonfinite_in_streamed_share"] = len(set(bad) & set(streamed_index))
        out["device_share"], out["streamed_share"] = len(device_index), len(streamed_index)
        stepper = host.stepper if isinstance(host, StreamedEngine) else None
        if stepper is not None and stepper._steps:
            counts = [float(t) for t in stepper._steps.values()]
            out["stepper_counts"] = [min(counts), max(counts)]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-medium")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", default="0@6,0.65@6")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    for variant in args.variants.split(","):
        try:
            out = run(args, variant)
        except Exception as exc:  # noqa: BLE001 - the next variant still runs
            out = {"variant": variant, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(out) + "\n")
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
