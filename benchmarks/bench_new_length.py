"""What a training step costs at a sequence length it has not seen before, and where that time goes.

`fit` tunes a GPT-2 (random weights) for padded batches of lengths `--min-length` to `--max-length`, as
bench_lengths.py does; then, under `plan.apply`, each of `--lengths` new lengths gets two steps in a row: the
first pays whatever is built once per shape, the second does not. The two are timed with the GPU synchronized,
so their difference is the cost of a new length on this plan. One more pair runs under torch.profiler, and the
operators whose host time grew most on the new length's step are listed, which names what is built per shape
(cuDNN's attention plans, cuBLAS heuristics, compiled-code guards or kernels).

`--sdpa` picks scaled_dot_product_attention's backends before `fit`, so the plan is tuned and trained with
them: `default` leaves torch's choice, `no-cudnn` turns cuDNN's attention off
(torch.backends.cuda.enable_cudnn_sdp(False)), `efficient` keeps only the memory-efficient kernel and math.
`--no-attention-buckets` runs attention at each batch's own length, not rounded up to a multiple of 64 tokens
as a plan does under cuDNN's attention (so each new length here is a new shape for cuDNN).

    python benchmarks/bench_new_length.py --sdpa default --out new_length.jsonl
    python benchmarks/bench_new_length.py --sdpa default --no-attention-buckets --out new_length.jsonl
    python benchmarks/bench_new_length.py --sdpa no-cudnn --out new_length.jsonl
    python benchmarks/bench_new_length.py --model tiny-gpt --device cpu --budget 64MiB --min-length 8 \\
        --max-length 32 --global-batch-size 8 --lengths 3 --out /tmp/new_length.jsonl      # a CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_lengths import padded_example
from workloads import build_gpt, cap_memory, environment

import autotune


def set_sdpa(choice: str) -> None:
    """Enable only the scaled-dot-product-attention backends `choice` names (process-wide, before tracing)."""
    if choice in ("no-cudnn", "efficient"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    if choice == "efficient":
        torch.backends.cuda.enable_flash_sdp(False)


def batch_of_length(n: int, length: int, vocab: int, device: str, seed: int, masks: bool) -> dict[str, torch.Tensor]:
    """`n` samples padded to exactly `length` tokens: one sample that long, the others shorter, as padding gives."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, length // 4), length + 1, (n,), generator=g)
    lengths[0] = length
    ids = torch.randint(0, vocab, (n, length), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    batch = {"input_ids": ids, "labels": ids.masked_fill(~mask, -100)}
    if masks:
        batch["attention_mask"] = mask.long()
    return {k: v.to(device) for k, v in batch.items()}


def timed(step: Callable[[Any], Any], batch: Any, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(batch)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def host_time_by_op(step: Callable[[Any], Any], batch: Any, device: str) -> Counter[str]:
    """Each operator's self host time (µs) over one step, as torch.profiler counts it."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        timed(step, batch, device)
    return Counter({e.key: e.self_cpu_time_total for e in prof.key_averages()})


def grown(new: Counter[str], again: Counter[str], top: int = 12) -> list[tuple[str, float]]:
    """The operators whose host time grew most from the repeated length's step to the new length's, in ms."""
    diff = {k: (new[k] - again.get(k, 0)) / 1e3 for k in new}
    return [(k, round(v, 2)) for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[:top]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-medium")
    parser.add_argument("--budget", default="10GiB")
    parser.add_argument("--min-length", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--lengths", type=int, default=12, help="how many new lengths get a pair of steps")
    parser.add_argument("--sdpa", choices=("default", "no-cudnn", "efficient"), default="default")
    parser.add_argument("--no-attention-buckets", action="store_true",
                        help="AUTOTUNE_ATTENTION_BUCKETS=0: attention at each batch's own length")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    set_sdpa(args.sdpa)
    if args.no_attention_buckets:
        os.environ["AUTOTUNE_ATTENTION_BUCKETS"] = "0"
    cap_memory(args.device, args.budget)
    model, example = build_gpt(args.model, args.device, args.max_length)
    masks = hasattr(model, "config")  # the tiny GPT of the dry run takes no attention mask
    vocab = model.config.vocab_size if masks else model.cfg.vocab_size
    if masks:
        example = padded_example(example["input_ids"].shape[0], args.min_length, args.max_length, vocab, args.device)
    row: dict[str, Any] = {"model": args.model, "budget": args.budget, "sdpa": args.sdpa,
                           "attention_buckets": not args.no_attention_buckets,
                           "lengths": [args.min_length, args.max_length], **environment(args.device)}
    started = time.perf_counter()
    plan = autotune.fit(model, example, global_batch_size=args.global_batch_size, memory_budget=args.budget,
                        device=args.device, cache=False, max_length=args.max_length)
    row.update(tune_s=round(time.perf_counter() - started, 1), plan=plan.summary(),
               estimate_tokens_per_s=plan.tokens_per_second)
    print(json.dumps(row), flush=True)
    n = args.global_batch_size
    # New lengths from the top of the range down, where padding to a batch's longest sample puts most batches.
    span = max(1, (args.max_length - args.min_length) // (4 * (args.lengths + 2)))
    lengths = [args.max_length - span * (i + 1) for i in range(args.lengths + 1)]
    pairs = []
    with plan.apply(model, torch.optim.AdamW(model.parameters(), lr=1e-5)) as step:
        for seed in range(3):  # warm at the longest length, which fit's trials ran
            timed(step, batch_of_length(n, args.max_length, vocab, args.device, seed, masks), args.device)
        for i, length in enumerate(lengths[:-1]):
            first = timed(step, batch_of_length(n, length, vocab, args.device, 10 + i, masks), args.device)
            again = timed(step, batch_of_length(n, length, vocab, args.device, 100 + i, masks), args.device)
            pairs.append((length, round(first, 4), round(again, 4)))
        new = host_time_by_op(step, batch_of_length(n, lengths[-1], vocab, args.device, 7, masks), args.device)
        repeat = host_time_by_op(step, batch_of_length(n, lengths[-1], vocab, args.device, 8, masks), args.device)
        recoveries = len(step.recoveries)
    extra = sorted(f - a for _, f, a in pairs)
    row.update(pairs=pairs, median_first=sorted(f for _, f, _ in pairs)[len(pairs) // 2],
               median_again=sorted(a for _, _, a in pairs)[len(pairs) // 2],
               median_new_length_cost_s=round(extra[len(extra) // 2], 4), recoveries=recoveries,
               attention_ops=sorted(k for k in new if "attention" in k), grown_ms=grown(new, repeat))
    print(json.dumps(row), flush=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
