"""Optimizer offload, serial against overlapped: where a global step's time goes.

For each mode, the same plan trains `--steps` global steps through `plan.apply` (after `--warmup`), and
each step is split at the optimizer: `backward` is from the start of the step to the moment the step
calls the host optimizer (every micro-batch's forward and backward, the device synchronised), `tail` is
that call to its end (the remaining CPU steps, the copies back, waiting for the worker). Serial offload
does all of its host work in the tail; overlapped offload steps chunks during the last backward, and the
tail keeps only what was left. Also reported: tokens/s of the whole step, the chunks the worker stepped
before the tail began, the peak memory.

    python benchmarks/bench_offload.py --workload W1 --config 0,8 --compile --steps 20 --out w1.jsonl
    python benchmarks/bench_offload.py --workload W2 --fit --steps 20 --out w2.jsonl
    python benchmarks/bench_offload.py --workload tiny --config 0,4 --steps 3            # CPU smoke run

`--config BLOCKS,MICRO[,FRACTION]`: blocks recomputed, micro-batch, host share (default 1.0). `--fit`
tunes the plan first (cache off; the search measures with overlap on) and trains that plan in both modes.
Mode `none` skips the optimizer step (the weights never change): the step's time without it, so that
`step - none` is what the optimizer adds to a step however it splits between backward and tail.
Modes switch with $AUTOTUNE_OFFLOAD_OVERLAP (read when the step is built), in one process, one after the
other, with the memory cap of the workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import build_gpt, cap_memory, environment

import autotune
from autotune.plan import Plan
from autotune.sizes import parse_bytes
from autotune.techniques.offload import HostSteppedEngine, StreamedEngine
from autotune.techniques.offload import streamed as offload_stream
from autotune.workload import batch as batches
from autotune.workload.batching import solve_accumulation

DEFAULT_SEGMENT = offload_stream.SEGMENT
WORKLOADS = {  # model, sequence, budget, global batch, device
    "W1": ("gpt2-large", 1024, "24GiB", 64, "cuda"),
    "W2": ("gpt2-xl", 1024, "16GiB", 64, "cuda"),
    "M16": ("gpt2-medium", 1024, "16GiB", 64, "cuda"),  # the multi-GPU issue's one-GPU case
    "tiny": ("tiny-gpt", 64, "4GiB", 8, "cpu"),
}


def config_parser(doc: str, *, workload: str, config: str, steps: int, warmup: int) -> argparse.ArgumentParser:
    """The options this script, bench_trial_accuracy.py and profile_step.py share: a workload, a
    hand-built configuration (`make_plan`), steps to time after a warm-up, a JSON-lines file."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default=workload)
    parser.add_argument("--config", default=config, help="BLOCKS,MICRO[,FRACTION]: blocks recomputed, micro-batch, "
                        f"host share (default {config})")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model, as W1's lattice plan does")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--out", default="")
    return parser


@dataclasses.dataclass
class Setup:
    """A workload built for `--workload`, on its device, under its memory cap."""

    seq: int
    budget: str
    global_batch: int
    device: str
    model: torch.nn.Module
    example: Any

    def plan(self, args: argparse.Namespace) -> Plan:
        return make_plan(args, self.device, parse_bytes(self.budget), self.global_batch)


def set_up(args: argparse.Namespace) -> Setup:
    name, seq, budget, global_batch, device = WORKLOADS[args.workload]
    cap_memory(device, budget)
    model, example = build_gpt(name, device, seq)
    return Setup(seq, budget, global_batch, device, model, example)


def make_plan(args: argparse.Namespace, device: str, budget: int, global_batch: int) -> Plan:
    blocks, micro, *rest = (float(x) for x in args.config.split(","))
    blocks, micro = int(blocks), int(micro)
    steps, last = solve_accumulation(global_batch, micro)
    return Plan.of(precision="bf16", checkpointing="none" if blocks == 0 else "selective", checkpointed_blocks=blocks,
                offload="optimizer", offload_fraction=rest[0] if rest else None, compile=args.compile,
                micro_batch_size=micro, accumulation_steps=steps, world_size=1, global_batch_size=global_batch,
                last_micro_batch_size=last, peak_memory_bytes=0, memory_budget_bytes=budget, margin=0.1,
                samples_per_second=0.0, device="cuda" if device.startswith("cuda") else "cpu")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def mark(device: str) -> Any:
    """A point on the device's timeline: a CUDA event recorded on the current stream (the GPU reaches it once
    the work queued before it is done, the host does not wait), else a clock reading."""
    if not device.startswith("cuda"):
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds_between(start: Any, end: Any) -> float:
    """Seconds from one `mark` to a later one (waits for the later one to be reached)."""
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def timed_optimizer(step: Any, device: str, record: dict[str, list[float]], *, skip: bool = False) -> None:
    """Wrap the host optimizer's `step` to time its tail, from the end of the last backward on the device to the
    step's end, and count the chunks stepped (issued, for the streamed engine) before it (`skip`: the optimizer
    does nothing, for the step's time without it). The tail starts at a mark on the device's timeline, not at a
    synchronize: waiting for the device there would let the host step's queued work finish before it is timed."""
    host = step.optimizer
    inner = (lambda: None) if skip else host.step

    def step_and_time() -> None:
        start = mark(device)
        pipeline = host.pipeline if isinstance(host, HostSteppedEngine) else None
        stepper = host.stepper if isinstance(host, StreamedEngine) else None
        if stepper is not None:  # streamed: segments issued during the last backward, of all
            record["chunks_before_tail"].append(stepper.early if stepper.armed else 0)
            record["chunks_total"].append(stepper.segments if stepper.armed else 0)
        else:
            record["chunks_before_tail"].append(pipeline.chunks_stepped if pipeline is not None else 0)
            record["chunks_total"].append(len(pipeline.chunks) if pipeline is not None else 0)
        inner()
        record["tail_seconds"].append(seconds_between(start, mark(device)))
        if pipeline is not None:
            pipeline.chunks_stepped = 0

    host.step = step_and_time


def run_mode(label: str, plan: Plan, model: torch.nn.Module, batch: Any, args: argparse.Namespace,
             device: str, seq: int) -> dict[str, Any]:
    mode, _, segment = label.partition("@")  # stream-overlap@16: segments of 16 Mi elements
    offload_stream.SEGMENT = int(segment) << 20 if segment else DEFAULT_SEGMENT
    os.environ["AUTOTUNE_OFFLOAD_OVERLAP"] = "1" if mode.endswith("overlap") else "0"
    os.environ["AUTOTUNE_OFFLOAD_STREAM"] = "1" if mode.startswith("stream") else "0"
    # No user optimizer: the step builds AdamW from the plan, and close() has no state to hand back (W2's
    # 12 GB of moments would not fit on the device beside the model). The streamed step overlaps only where
    # the plan says so, as fit decides it.
    step = plan.with_config(offload_overlap=mode.endswith("overlap")).apply(model)
    record: dict[str, list[float]] = {k: [] for k in ("tail_seconds", "chunks_before_tail", "chunks_total")}
    timed_optimizer(step, device, record, skip=mode == "none")
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    totals, tails, befores = [], [], []
    try:
        for i in range(args.warmup + args.steps):
            sync(device)
            started = time.perf_counter()
            step(batch)
            sync(device)
            ended = time.perf_counter()
            if i >= args.warmup:
                totals.append(ended - started)
                tails.append(record["tail_seconds"][-1])
                befores.append(record["chunks_before_tail"][-1])
    finally:
        step.close()
    total, tail = statistics.median(totals), statistics.median(tails)
    peak = torch.cuda.max_memory_reserved() if device.startswith("cuda") else 0
    allocated = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
    by_stream: dict[str, int] = {}  # reserved segments by the stream that allocated them: side streams' pools
    if device.startswith("cuda"):
        for seg in torch.cuda.memory_snapshot():
            by_stream[str(seg.get("stream"))] = by_stream.get(str(seg.get("stream")), 0) + seg["total_size"]
    return {"mode": label, "step_s": total, "backward_s": total - tail, "tail_s": tail,
            "tail_share": tail / total, "tok_s": plan.global_batch_size * seq / total,
            "chunks_before_tail": statistics.median(befores), "chunks": record["chunks_total"][-1],
            "peak_reserved_gib": peak / 2**30, "peak_allocated_gib": allocated / 2**30,
            "reserved_by_stream_mib": {k: v / 2**20 for k, v in by_stream.items()}, "recoveries": len(step.recoveries),
            "steps": len(totals)}


def main() -> None:
    parser = config_parser(__doc__, workload="W1", config="0,8", steps=20, warmup=2)  # 0,8: W1's lattice plan
    parser.add_argument("--fit", action="store_true", help="tune the plan with autotune.fit instead of --config")
    parser.add_argument("--modes", default="serial,overlap,stream-serial,stream-overlap",
                        help="serial/overlap: the host share stepped by the CPU; stream-*: on the GPU, its state "
                        "streamed (techniques/offload/streamed.py), after backward or issued from the last "
                        "backward's hooks; "
                        "MODE@N streams segments of N Mi elements; comma-separated, run in this order")
    args = parser.parse_args()
    setup = set_up(args)
    seq, budget, global_batch, device, model, example = (setup.seq, setup.budget, setup.global_batch, setup.device,
                                                          setup.model, setup.example)
    batch = batches.resize(example, global_batch)
    env = environment(device)
    if args.fit:
        started = time.perf_counter()
        plan = autotune.fit(model, example, global_batch_size=global_batch, memory_budget=budget, device=device,
                            cache=False)
        print(f"fit in {time.perf_counter() - started:.0f} s: {plan.summary()}\n  {plan.reason}", flush=True)
    else:
        plan = setup.plan(args)
    if plan.offload != "optimizer":
        raise SystemExit(f"the plan is {plan.rung.name}, without optimizer offload: nothing to compare")
    print(f"{args.workload}: {plan.rung.name}, micro-batch {plan.micro_batch_size} x {plan.accumulation_steps}, "
          f"offload fraction {plan.offload_fraction:.2f}; {env['device']}", flush=True)
    rows = []
    for mode in args.modes.split(","):
        row = run_mode(mode, plan, model, batch, args, device, seq)
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        rows.append(row)
        print(f"  {mode:14} step {row['step_s']:7.3f} s = backward {row['backward_s']:7.3f} "
              f"+ tail {row['tail_s']:7.3f} s ({row['tail_share']:5.1%});  {row['tok_s']:9,.0f} tok/s;  worker stepped "
              f"{row['chunks_before_tail']:.0f}/{row['chunks']} chunks before the tail;  peak "
              f"{row['peak_reserved_gib']:.2f} GiB", flush=True)
    for row in rows[1:]:
        print(f"  {row['mode']} against {rows[0]['mode']}: "
              f"tail cut {rows[0]['tail_s'] / max(row['tail_s'], 1e-9):.2f}x, "
              f"tail share cut {rows[0]['tail_share'] / max(row['tail_share'], 1e-9):.2f}x, tok/s "
              f"{row['tok_s'] / rows[0]['tok_s']:.2f}x", flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps({"workload": args.workload, "plan": plan.rung.name,
                                    "micro": plan.micro_batch_size, "fraction": plan.offload_fraction,
                                    "fit": args.fit, **row, **env}) + "\n")


if __name__ == "__main__":
    main()
