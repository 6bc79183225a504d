"""Saved-activation offload against none: a GPT-2-large-shaped model's training step on one CUDA GPU.

Times `--steps` steps (forward, backward, AdamW step; bf16 autocast) after `--warmup`, first with no offload,
then with what autograd saves inside the first `--blocks` transformer blocks (all by default) streamed to
the host and back (`autotune/techniques/offload/activations.py`). Prints, per mode, the median step time and
the peak device memory, then the ratio of the step times and the overlap: the copies' serial time (the bytes
moved per step, each way, timed as one pinned copy of that size plus the host copy between the staging slots
and pageable memory) against the time the offload added to the step. Overlap 100% means every copy hid
behind compute; 0% means the step grew by their whole serial time.

    python benchmarks/bench_activation_offload.py                         # GPT-2 large, seq 1024, micro 4
    python benchmarks/bench_activation_offload.py --micro 8 --blocks 12 --out act.jsonl
    python benchmarks/bench_activation_offload.py --model tiny-gpt --seq 64 --device cpu --steps 2   # smoke

`--blocks K` offloads the first K blocks only (the others keep their tensors); `--min-kib` sets the size
under which a saved tensor stays on the device. `--out` appends one JSON line per run.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import build_gpt, environment

from autotune.techniques.offload.activations import MIN_BYTES, install


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _steps(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: str, steps: int, warmup: int
           ) -> tuple[float, int]:
    """Median seconds of a training step, and the peak device bytes over the timed steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    for i in range(warmup + steps):
        if i == warmup and device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            out = model(**batch)
        loss = out if isinstance(out, torch.Tensor) else out.loss  # the examples' GPT returns the loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
    del optimizer
    return statistics.median(times), peak


def _serial_copy_seconds(nbytes: int, device: str, repeats: int = 3) -> float:
    """Seconds to copy `nbytes` to the host and back through pinned memory, with the host copies between
    pinned and pageable memory: what the offload's copies cost a step were none of them hidden."""
    if nbytes == 0:
        return 0.0
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        pinned.copy_(source, non_blocking=True)
        _sync(device)
        pageable.copy_(pinned)
        pinned.copy_(pageable)
        source.copy_(pinned, non_blocking=True)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-large")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--blocks", type=int, default=None, help="offload the first K blocks (default: all)")
    parser.add_argument("--min-kib", type=int, default=MIN_BYTES >> 10)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    model, example = build_gpt(args.model, args.device, args.seq)
    model.train()
    rows = -(-args.micro // example["input_ids"].shape[0])
    batch = {k: v.repeat(rows, 1)[:args.micro] for k, v in example.items()}
    layers = model.transformer.h if hasattr(model, "transformer") else model.blocks
    blocks = list(layers)[:args.blocks]

    plain, plain_peak = _steps(model, batch, args.device, args.steps, args.warmup)
    offload, remove = install(blocks, torch.device(args.device), min_bytes=args.min_kib << 10)
    try:
        streamed, streamed_peak = _steps(model, batch, args.device, args.steps, args.warmup)
        moved, pinned, stored = offload.moved.bytes, offload.pinned_bytes, offload.stored_bytes
    finally:
        remove()
    serial = _serial_copy_seconds(moved, args.device)
    added = max(0.0, streamed - plain)
    hidden = 1.0 - min(1.0, added / serial) if serial else 1.0
    result: dict[str, Any] = {
        "model": args.model, "seq": args.seq, "micro": args.micro, "blocks": len(blocks),
        "step_none_s": plain, "step_offload_s": streamed, "ratio": streamed / plain,
        "peak_none_bytes": plain_peak, "peak_offload_bytes": streamed_peak,
        "moved_bytes_per_step": moved, "pinned_bytes": pinned, "stored_bytes": stored,
        "copies_serial_s": serial, "copies_hidden": hidden, "environment": environment(args.device),
    }
    gib = 1 << 30
    print(f"{args.model} seq {args.seq} micro {args.micro}, {len(blocks)} blocks offloaded")
    print(f"  no offload      {plain * 1e3:8.1f} ms/step  peak {plain_peak / gib:6.2f} GiB")
    print(f"  saved offload   {streamed * 1e3:8.1f} ms/step  peak {streamed_peak / gib:6.2f} GiB  "
          f"(pinned {pinned / gib:.2f} GiB, stored {stored / gib:.2f} GiB)")
    print(f"  ratio {streamed / plain:.3f}; {moved / gib:.2f} GiB each way per step, {serial * 1e3:.1f} ms if "
          f"serial; overlap {hidden:.0%} of the copies hidden ({added * 1e3:.1f} ms added)")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
