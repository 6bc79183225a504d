"""What recovering from an OOM mid-training costs, and whether the loss curve notices.

A plan is tuned at a short sequence length; training then switches to longer sequences than the plan was
tuned for, under the same memory ceiling, and `step(batch)` recovers (smaller micro-batch, or a higher
rung). A reference run trains the same weights on the same batches with the same plan and no ceiling.
Reported: seconds lost to each recovery (the failed attempt and its clean-up), the extra time of each
recovering step over the reference step, steady-state step times, and the loss curves side by side.

    python benchmarks/bench_recovery.py --out recovery.jsonl                          # GPU: real ceiling
    python benchmarks/bench_recovery.py --device cpu --out /tmp/recovery.jsonl        # CPU: simulated ceiling
    python benchmarks/bench_recovery.py --model hf-gpt2 --budget 10GiB --long-seq 2048 --out r.jsonl

On CUDA the ceiling is `torch.cuda.set_per_process_memory_fraction(budget / total)`, so OOMs are the
allocator's own; on the CPU it is the plan's simulated ceiling. JSON lines go to --out: one per step and
run, then one summary line. Exit status 3 when nothing ran out of memory (nothing was measured).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, ".."))

import autotune  # noqa: E402
from autotune.sizes import parse_bytes  # noqa: E402
from autotune.training.step import TrainingStep  # noqa: E402

# Defaults per device: a GPT-2-small-sized model on a GPU, a toy on the CPU (the simulation is slow).
DEFAULTS = {
    "cuda": dict(layers=12, width=768, heads=12, vocab=50257, tuned_seq=256, long_seq=1024, global_batch_size=16,
                 budget="6GiB", short_steps=10, long_steps=20, techniques="bf16,checkpointing,offload"),
    # bf16 only on the CPU: the plan is then a plain micro-batch, which the long sequences must overflow
    # (the CPU's throughput is too noisy for the rung chosen to be the same every run).
    "cpu": dict(layers=4, width=64, heads=4, vocab=512, tuned_seq=32, long_seq=128, global_batch_size=8,
                budget="12MiB", short_steps=3, long_steps=4, techniques="bf16"),
}

MakeBatch = Callable[[int, int, torch.Generator], Any]


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, MakeBatch]:
    """The model (random weights, nothing downloaded) and a batch maker `(n, seq, generator) -> batch`."""
    max_seq = max(args.tuned_seq, args.long_seq)
    if args.model == "gpt":
        from gpt import GPT, GPTConfig  # examples/gpt.py: explicit attention, memory grows with T^2

        model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=max_seq, n_layer=args.layers, n_head=args.heads,
                              n_embd=args.width))

        def make(n: int, seq: int, g: torch.Generator) -> Any:
            ids = torch.randint(0, args.vocab, (n, seq + 1), generator=g)
            return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

        return model, make
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=args.vocab, n_positions=max_seq, n_layer=args.layers, n_embd=args.width,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        attn_implementation="eager")

    def make_hf(n: int, seq: int, g: torch.Generator) -> Any:
        ids = torch.randint(0, args.vocab, (n, seq), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}

    return GPT2LMHeadModel(config), make_hf


def set_ceiling(device: str, budget: int | None) -> None:
    """On CUDA, cap this process's allocator at `budget` bytes (None lifts the cap). The CPU needs nothing:
    the plan carries its simulated ceiling."""
    if device != "cuda":
        return
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0 if budget is None else min(1.0, budget / total), 0)


def now(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def schedule(args: argparse.Namespace) -> list[int]:
    """Sequence length of each optimizer step: the tuned length, then the long one."""
    return [args.tuned_seq] * args.short_steps + [args.long_seq] * args.long_steps


def train(run: str, plan: autotune.Plan, model: torch.nn.Module, make: MakeBatch, args: argparse.Namespace,
          out: list[dict[str, Any]]) -> TrainingStep:
    """Train one run over the schedule, appending one record per step to `out`."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step = TrainingStep(plan, model, optimizer, techniques=args.techniques,
                        grow_after=args.grow_after if run == "ceiling" else None)
    g = torch.Generator().manual_seed(args.seed)  # both runs see the same batches
    for i, seq in enumerate(schedule(args)):
        batch = make(args.global_batch_size, seq, g)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seen = len(step.recoveries)
        t0 = now(args.device)
        loss = step(batch)
        seconds = now(args.device) - t0
        new = step.recoveries[seen:]
        peak = torch.cuda.max_memory_reserved() if args.device == "cuda" else step.last_peak_bytes
        out.append({"run": run, "step": i, "seq": seq, "loss": loss, "seconds": seconds,
                    "micro_batch": step.plan.micro_batch_size, "rung": step.plan.rung.name,
                    "recoveries": len(new), "seconds_lost": sum(r.seconds for r in new),
                    "recovered_to": [r.now for r in new], "peak_bytes": peak})
    step.close()
    return step


def summarise(plan: autotune.Plan, step: TrainingStep, rows: list[dict[str, Any]], args: argparse.Namespace) -> dict:
    ceiling = [r for r in rows if r["run"] == "ceiling"]
    reference = [r for r in rows if r["run"] == "reference"]
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(ceiling, reference)]
    recovering = [(a, b) for a, b in zip(ceiling, reference) if a["recoveries"]]
    tail = max(1, args.long_steps // 2)  # steady state: the second half of the long steps
    return {
        "summary": True,
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (simulated ceiling)",
        "torch": torch.__version__,
        "model": f"{args.model} {args.layers}x{args.width}, vocab {args.vocab}",
        "budget_bytes": parse_bytes(args.budget),
        "tuned_plan": plan.summary(),
        "final_plan": step.plan.summary(),
        "recoveries": [dataclasses.asdict(r) for r in step.recoveries],
        "seconds_lost": sum(r.seconds for r in step.recoveries),
        "recovering_steps_extra_seconds": sum(a["seconds"] - b["seconds"] for a, b in recovering),
        "steady_seconds_ceiling": median([r["seconds"] for r in ceiling[-tail:]]),
        "steady_seconds_reference": median([r["seconds"] for r in reference[-tail:]]),
        "max_abs_loss_diff": max(diffs),
        "max_rel_loss_diff": max(d / abs(b["loss"]) for d, b in zip(diffs, reference)),
        "final_loss_ceiling": ceiling[-1]["loss"],
        "final_loss_reference": reference[-1]["loss"],
    }


def median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def print_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    ceiling = [r for r in rows if r["run"] == "ceiling"]
    reference = [r for r in rows if r["run"] == "reference"]
    print(f"\n{'step':>4} {'seq':>5}  {'under the ceiling: plan':38} {'loss':>8} {'s':>7} {'lost s':>7}   "
          f"{'reference: loss':>15} {'s':>7}  {'|dloss|':>8}")
    for a, b in zip(ceiling, reference):
        plan = f"{a['rung']} x micro {a['micro_batch']}"
        lost = f"{a['seconds_lost']:7.3f}" if a["recoveries"] else f"{'':7}"
        print(f"{a['step']:4d} {a['seq']:5d}  {plan:38} {a['loss']:8.4f} {a['seconds']:7.3f} {lost}   "
              f"{b['loss']:15.4f} {b['seconds']:7.3f}  {abs(a['loss'] - b['loss']):8.2e}")
    print(f"\ntuned:  {summary['tuned_plan']}\nfinal:  {summary['final_plan']}")
    for r in summary["recoveries"]:
        print(f"  step {r['step']}: OOM at {r['failed']} (micro-step {r['micro_step']}) -> {r['now']}, "
              f"{r['seconds']:.3f} s lost")
    print(f"seconds lost to recoveries: {summary['seconds_lost']:.3f}; recovering steps took "
          f"{summary['recovering_steps_extra_seconds']:+.3f} s beyond the reference's")
    print(f"steady step time: {summary['steady_seconds_ceiling']:.3f} s under the ceiling, "
          f"{summary['steady_seconds_reference']:.3f} s without")
    if not summary["recoveries"]:
        print("NO OOM: nothing was recovered from, so this measured nothing; raise --long-seq or lower --budget")
    print(f"loss curves: max |difference| {summary['max_abs_loss_diff']:.2e} "
          f"(relative {summary['max_rel_loss_diff']:.2e}); final {summary['final_loss_ceiling']:.4f} vs "
          f"{summary['final_loss_reference']:.4f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=("gpt", "hf-gpt2"), default="gpt",
                        help="examples/gpt.py, or transformers' GPT2LMHeadModel (eager attention)")
    for name in ("layers", "width", "heads", "vocab", "tuned_seq", "long_seq", "global_batch_size",
                 "short_steps", "long_steps"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None, help="default: per device")
    parser.add_argument("--budget", default=None, help="memory budget, e.g. 6GiB (default: per device)")
    parser.add_argument("--techniques", default=None, help="allowed rungs for fit and recovery, e.g. "
                        "bf16,checkpointing (default: per device)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grow-after", type=int, default=None,
                        help="let the micro-batch grow back after N clean steps")
    parser.add_argument("--out", default=None, help="write JSON lines here")
    parser.add_argument("--cache", default=None,
                        help="plan cache a recovery writes to (default: a temporary file, not your own cache)")
    args = parser.parse_args(argv)
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget = parse_bytes(args.budget)
    # A recovery marks the plan unsafe in $AUTOTUNE_CACHE: part of its cost, but not in the user's cache.
    os.environ["AUTOTUNE_CACHE"] = args.cache or os.path.join(tempfile.mkdtemp(prefix="bench_recovery"), "plans.db")
    torch.manual_seed(args.seed)
    model, make = build(args)
    model.to(args.device)
    initial = copy.deepcopy(model.state_dict())
    g = torch.Generator().manual_seed(args.seed + 1)

    set_ceiling(args.device, budget)
    try:
        plan = autotune.fit(model, make(8, args.tuned_seq, g), global_batch_size=args.global_batch_size,
                            memory_budget=budget, device=args.device, cache=False, techniques=args.techniques)
        print(f"tuned at seq {args.tuned_seq}: {plan.summary()}\n  {plan.reason}")
        rows: list[dict[str, Any]] = []
        step = train("ceiling", plan, model, make, args, rows)
    finally:
        set_ceiling(args.device, None)

    # The reference: same weights, same batches, same plan, and no ceiling to hit.
    model.load_state_dict(initial)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    unbounded = plan.with_config(memory_budget_bytes=2**62)
    train("reference", unbounded, model, make, args, rows)

    summary = summarise(plan, step, rows, args)
    print_table(rows, summary)
    if args.out:
        with open(args.out, "w") as f:
            for row in [*rows, summary]:
                f.write(json.dumps(row, default=str) + "\n")
        print(f"\nwrote {len(rows) + 1} JSON lines to {args.out}")
    if not all(math.isfinite(r["loss"]) for r in rows):
        return 1
    return 0 if summary["recoveries"] else 3


if __name__ == "__main__":
    raise SystemExit(main())
