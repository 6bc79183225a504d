"""Where a replicated step's time goes: one `fit`, then the plan trained with parts switched off.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_replicated_parts.py --model gpt2-medium --budget 16GiB
    python benchmarks/bench_replicated_parts.py ...        # one GPU: the plan's step, timed in parts
    ... --as 0.001@6@k4                                    # fit's plan at another share, micro-batch, recompute

Variants, in this order, each `--steps` steps of the same plan in the same process (timing only: the
switched-off parts leave the ranks' weights apart, which the next variant's broadcasts do not mend; the loss
is not the point here):
    as-planned       the plan as `plan.apply` trains it
    after-backward   one gradient bucket: the all-reduce starts when the last backward ends (no overlap)
    per-tensor       one all-reduce per gradient instead of one collective per bucket
    per-tensor-after-backward  both: one bucket, all-reduced a gradient at a time
    no-all-reduce    the gradients are not summed over ranks at all (what the all-reduce costs, overlapped)
    no-weight-share  partitioned offload's weight broadcast skipped (what it costs)
    parts            as planned, with a device synchronize around each part of the step: the micro-batches
                     before the last, the last backward with the all-reduce, the optimizer step
    waits            as planned, the host's time inside each of the step's agreements between ranks (the
                     sample count summed before the first micro-batch, the two OOM agreements): each waits
                     for the device and the other rank (no synchronize added)
    no-agree         the two OOM agreements skipped (unsafe: an OOM would hang the ranks; timing only)
    no-count-sum     the sample count not summed over ranks (every rank assumes the others have as many)
    as-planned       again: how far the first reading drifted
Rank 0 prints one JSON line and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_multi_gpu import _init, _train, variant_plan  # the same ranks and the same training loop
from workloads import build_gpt, cap_memory

import autotune
from autotune import parallel as distributed
from autotune.parallel import reduce as parallel_reduce
from autotune.techniques.offload import partition as offload_partition
from autotune.training.accumulate import Accumulator
from autotune.training.step import TrainingStep

VARIANTS = ("as-planned", "after-backward", "per-tensor", "per-tensor-after-backward", "no-all-reduce",
            "no-weight-share", "parts", "waits", "no-agree", "no-count-sum", "as-planned")


def main() -> None:
    a = _parse()
    world, rank = _init(a.device)
    device = f"cuda:{torch.cuda.current_device()}" if a.device == "cuda" else "cpu"
    cap_memory(device, a.budget)
    model, example = build_gpt(a.model, device, a.seq)
    started = time.perf_counter()
    plan = autotune.fit(model, example, global_batch_size=a.global_batch_size, memory_budget=a.budget, cache=False,
                        device=a.device)
    out: dict[str, Any] = {"model": a.model, "world_size": world, "budget": a.budget, "plan": plan.summary(),
                           "tune_seconds": time.perf_counter() - started,
                           "partition": os.environ.get("AUTOTUNE_OFFLOAD_PARTITION", "1"), "variants": []}
    variant = a.as_variant or (f"{a.fraction or plan.offload_fraction}@{a.micro or plan.micro_batch_size}"
                               if a.fraction or a.micro else "")  # the older flags, as a variant
    if variant:
        plan = variant_plan(plan, variant)
    if plan.summary() != out["plan"]:
        out["plan"] = f"{plan.summary()} (fit's: {out['plan']})"
    step = plan.apply(model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    names = a.variants.split(",") if a.variants else VARIANTS if world > 1 else ("as-planned", "parts", "as-planned")
    for name in names:
        with _variant(name) as parts:
            trained = _train(step, a, device, rank, world)
        seconds = trained["step_seconds"]
        row = {"variant": name, "step_seconds": seconds, "tokens_per_second": a.global_batch_size * a.seq / seconds,
               "alloc_retries": trained["alloc_retries"], "step_times": trained["step_times"],
               "mean_tokens_per_second": trained["mean_tokens_per_second"], "gc_pauses": trained["gc_pauses"]}
        if parts and name == "waits":  # several calls a step: the host's time in each, per step
            row["parts"] = {k: sum(v) / a.steps for k, v in parts.items()}
        elif parts:
            row["parts"] = {k: statistics.median(v[1:] or v) for k, v in parts.items()}
        out["variants"].append(row)
    step.close()
    if rank == 0:
        print(json.dumps(out), flush=True)
        for row in out["variants"]:
            extra = " ".join(f"{k} {v:.4f}" for k, v in row.get("parts", {}).items())
            gc_s = sum(seconds for _, seconds in row["gc_pauses"].values())  # Python's collections in the steps
            print(f"{row['variant']:>16} {row['step_seconds']:.4f} s {row['tokens_per_second']:>9,.0f} tok/s "
                  f"(mean {row['mean_tokens_per_second']:,.0f}) gc {gc_s:.3f} s retries {row['alloc_retries']} {extra}")
    if dist.is_initialized():
        dist.destroy_process_group()


class _variant:
    """Switch one part off (or time the parts) for the steps inside the block; put everything back after."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.saved: list[tuple[Any, str, Any]] = []
        self.parts: dict[str, list[float]] = {}

    def __enter__(self) -> dict[str, list[float]]:
        if self.name.endswith("after-backward"):
            self._set(distributed, "BUCKET_BYTES", 2**62)
        if self.name.startswith("per-tensor"):
            self._set(parallel_reduce, "_coalescing_manager", None)  # all_reduce_together's fallback: one per tensor
        if self.name == "no-all-reduce":
            def start(reduce: Any) -> None:
                reduce.started += 1
            self._set(distributed.OverlappedReduce, "_start", start)
        elif self.name == "no-weight-share":
            self._set(offload_partition.Partition, "share_weights", lambda part, params: None)
        elif self.name == "no-agree":
            self._set(distributed, "agree_oom", lambda oom: oom)
        elif self.name == "no-count-sum":
            world = distributed.world_size()
            self._set(distributed, "sum_over_ranks", lambda values: [v * world for v in values])
        elif self.name == "waits":
            for fn in ("agree_oom", "sum_over_ranks"):
                self._set(distributed, fn, self._waited(getattr(distributed, fn), fn))
        elif self.name == "parts":
            for owner, method, label in ((Accumulator, "forward", "micro_batches_but_last_backward"),
                                         (Accumulator, "last_backward", "last_backward"),
                                         (Accumulator, "finish", "all_reduce_wait"),
                                         (TrainingStep, "_optimizer_step", "optimizer")):
                self._set(owner, method, self._timed(getattr(owner, method), label))
        return self.parts

    def __exit__(self, *exc: Any) -> None:
        for owner, attr, value in reversed(self.saved):
            setattr(owner, attr, value)

    def _set(self, owner: Any, attr: str, value: Any) -> None:
        self.saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    def _waited(self, fn: Any, label: str) -> Any:
        parts = self.parts

        def waited(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            parts.setdefault(label, []).append(time.perf_counter() - t0)
            return result
        return waited

    def _timed(self, fn: Any, label: str) -> Any:
        parts = self.parts

        def timed(*args: Any, **kwargs: Any) -> Any:
            _sync()
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            _sync()
            parts.setdefault(label, []).append(time.perf_counter() - t0)
            return result
        return timed


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-medium")
    p.add_argument("--budget", default="16GiB")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--variants", default="", help="comma-separated, in this order (default: all of them)")
    p.add_argument("--fraction", type=float, default=0.0, help="train the plan with this host share instead of fit's")
    p.add_argument("--micro", type=int, default=0, help="train the plan at this micro-batch instead of fit's")
    p.add_argument("--as", dest="as_variant", default="", help="train fit's plan changed as SHARE[@MICRO][@kBLOCKS] "
                   "says (bench_multi_gpu.py --shares), e.g. 0.001@6 or 0@8@k12")
    args = p.parse_args()
    unknown = set(args.variants.split(",")) - set(VARIANTS) if args.variants else set()
    if unknown:  # a misspelt variant would otherwise train as planned under its own name
        p.error(f"unknown --variants {', '.join(sorted(unknown))}; known: {', '.join(dict.fromkeys(VARIANTS))}")
    return args


if __name__ == "__main__":
    main()
