"""A plan's figures in training: padded batches of varying length, or many steps of one shape.

`fit` tunes a GPT-2 from a transformers config (random weights) at `--max-length`, under a memory cap of
`--budget`; then `plan.apply` trains `--steps` global steps. With `--min-length` below `--max-length` each
batch draws its samples' lengths uniformly from that range and is padded to its longest (labels -100 on the
padding, as a collator does), so every step has another length; otherwise every batch is `--max-length` long.

With mixed lengths `fit`'s example is a batch as training will see it: samples of those lengths, one of them
`--max-length` long, padded with the attention mask, so the trials run the masked attention training runs.

Printed last, and appended to `--out` as one JSON line: the plan's estimate (tokens/s at the longest length)
and what training measured over the steps after the first 2: real tokens/s (padding left out) and the tokens/s
of the padded batches, the rate the estimate is for (`trained_over_estimate` is the padded rate over the
estimate: at the batches' mean padded length the plan expects the same rate per token); the graphs compiled
(dynamo's count) and recompiles, the recoveries, the reserved peak beside the plan's and the budget less its
margin, the process's resident memory, and the median step of the steps whose length is new beside those whose
length came before (a cost paid once per length: over lengths 256-1024 most of 100 steps bring a new one;
`--length-multiple 64` pads as a collator's `pad_to_multiple_of` does, to 13 lengths). Per step, on the device's
timeline: each micro-step before the last (`micro_step_seconds`) and the last with the optimizer step
(`last_micro_step_seconds`); under optimizer offload, how long the host's step ran on after the last backward
ended on the device and how many of its chunks it had stepped (or issued, streamed) during that backward (all
of them and a short tail: the host step hid behind the backward; none: it ran serially). With `--one-length`
each batch is instead of one length drawn from the range, unpadded and without a mask, and `fit`'s example is a
batch at `--max-length`; with `--example typical` too, it is a batch at the range's middle length, as a user hands
`fit` a batch from the loader beside `max_length` (the trials still run at `--max-length`, and the plan's estimate
is at the example's length). `--length-plan` gives those lengths in order instead (`640x5,1024x4`: five steps at
640 tokens, then four at 1024), to time one plan's step at fixed lengths: the first length on training's static
graph, a later one on the dynamic graph, a length off the 64-token grid on padded attention (CUDA).

    python benchmarks/bench_lengths.py --model gpt2-medium --budget 10GiB --min-length 256 --max-length 1024 \\
        --global-batch-size 32 --steps 100 --out lengths.jsonl
    python benchmarks/bench_lengths.py --model gpt2-large --budget 24GiB --max-length 1024 \\
        --global-batch-size 64 --steps 100 --out lengths.jsonl
    python benchmarks/bench_lengths.py --model gpt2-medium --budget 10GiB --min-length 256 --max-length 1024 \\
        --one-length --global-batch-size 32 --steps 100 --out lengths.jsonl
    python benchmarks/bench_lengths.py --model gpt2-medium --budget 10GiB --min-length 256 --max-length 1024 \\
        --one-length --example typical --global-batch-size 32 --steps 100 --out lengths.jsonl
    python benchmarks/bench_lengths.py --model gpt2-medium --budget 10GiB --min-length 256 --max-length 1024 \\
        --one-length --example typical --global-batch-size 32 --length-plan 640x5,1024x4,640x4,600x5,320x4 \\
        --out lengths.jsonl
    python benchmarks/bench_lengths.py --model tiny-gpt --device cpu --budget 64MiB --min-length 8 \\
        --max-length 32 --global-batch-size 8 --steps 4 --out /tmp/lengths.jsonl       # a CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_offload import mark, seconds_between, timed_optimizer
from workloads import build_gpt, cap_memory, environment

import autotune
from autotune.search.failures import FAILED
from autotune.sizes import parse_bytes
from autotune.techniques.offload import HostSteppedEngine, StreamedEngine


def batches(steps: int, n: int, low: int, high: int, vocab: int, device: str,
            masks: bool = True, multiple: int = 1, one_length: bool = False) -> list[dict[str, torch.Tensor]]:
    """`steps` batches of `n` samples, each sample's length uniform in [low, high], padded to the longest (with
    an attention mask where the model takes one: `masks`), rounded up to a multiple of `multiple` (as a collator
    with `pad_to_multiple_of` pads; never past `high`). With `one_length`, each batch's samples share one length
    drawn uniformly in [low, high] instead: no padding and no mask (sequence packing, or a sampler that groups by
    length, gives such batches)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        if one_length:
            out.append(_one_length(n, int(torch.randint(low, high + 1, (1,), generator=g)), vocab, device, g))
            continue
        lengths = torch.randint(low, high + 1, (n,), generator=g)
        longest = min(high, -(-int(lengths.max()) // multiple) * multiple)
        ids = torch.randint(0, vocab, (n, longest), generator=g)
        mask = torch.arange(longest)[None, :] < lengths[:, None]
        labels = ids.masked_fill(~mask, -100)
        batch = {"input_ids": ids, "labels": labels} | ({"attention_mask": mask.long()} if masks else {})
        out.append({k: v.to(device) for k, v in batch.items()})
    return out


def _length_plan(text: str) -> list[tuple[int, int]]:
    """"640x5,1024x4" -> [(640, 5), (1024, 4)]."""
    plan = []
    for part in text.split(","):
        length, _, steps = part.strip().partition("x")
        if not (length.isdigit() and steps.isdigit() and int(length) > 0 and int(steps) > 0):
            raise SystemExit(f"--length-plan: {part!r} is not LENGTHxSTEPS (e.g. 640x5)")
        plan.append((int(length), int(steps)))
    return plan


def planned_batches(text: str, n: int, vocab: int, device: str) -> list[dict[str, torch.Tensor]]:
    """Batches of `n` samples of one length each, unmasked, in the order and counts `--length-plan` gives."""
    g = torch.Generator().manual_seed(1)
    out = []
    for length, steps in _length_plan(text):
        out.extend(_one_length(n, length, vocab, device, g) for _ in range(steps))
    return out


def _one_length(n: int, length: int, vocab: int, device: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A batch of `n` samples `length` tokens long: no padding, no mask, the labels the ids."""
    ids = torch.randint(0, vocab, (n, length), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


def padded_example(rows: int, low: int, high: int, vocab: int, device: str) -> dict[str, torch.Tensor]:
    """A batch of `rows` samples of lengths in [low, high], the first `high` long, padded as training pads."""
    batch = batches(1, rows, low, high, vocab, "cpu")[0]
    longest = batch["input_ids"].shape[1]
    if longest < high:  # make the first sample the longest training will see
        pad = high - longest
        batch = {k: torch.nn.functional.pad(v, (0, pad), value=-100 if k == "labels" else 0) for k, v in batch.items()}
    ids = torch.randint(0, vocab, (high,), generator=torch.Generator().manual_seed(2))
    batch["input_ids"][0], batch["labels"][0], batch["attention_mask"][0] = ids, ids, 1
    return {k: v.to(device) for k, v in batch.items()}


def _first_and_again(seconds: list[float], lengths: list[int]) -> tuple[float | None, float | None]:
    """The median step of the steps whose length came for the first time, and of those whose length came before:
    a cost paid once per length shows as the gap between the two."""
    seen: set[int] = set()
    first, again = [], []
    for s, n in zip(seconds, lengths):
        (again if n in seen else first).append(s)
        seen.add(n)

    def median(xs: list[float]) -> float | None:
        return round(sorted(xs)[len(xs) // 2], 4) if xs else None

    return median(first), median(again)


def _marking(starts: list[Any], device: str) -> Any:
    """A forward pre-hook that marks the device's timeline at each forward of the model: each micro-step's start
    (a recomputed block re-runs its own forward, not the model's). Kept out of a compiled graph."""
    @torch.compiler.disable
    def at_forward(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        starts.append(mark(device))
    return at_forward


def _compiled_frames() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"]), int(sum(counters["recompiles"].values()))


def main(argv: list[str] | None = None) -> None:
    """`argv`: the arguments after the script's name (default: the command line's)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-medium")
    parser.add_argument("--budget", default="10GiB")
    parser.add_argument("--min-length", type=int, default=None, help="default: --max-length (one shape)")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--allocator", choices=("autotune", "fixed"), default="autotune",
                        help="autotune: the caching allocator as fit sets it (expandable segments); fixed: "
                             "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False before CUDA starts, the allocator's "
                             "default, which fit then keeps")
    parser.add_argument("--length-multiple", type=int, default=1,
                        help="pad each batch to a multiple of this many tokens, as a collator's pad_to_multiple_of "
                             "does: fewer distinct lengths in training (default 1: to the longest sample)")
    parser.add_argument("--one-length", action="store_true",
                        help="each batch of one length drawn from [--min-length, --max-length], no padding and no "
                             "attention mask (fit's example then is a batch at --max-length)")
    parser.add_argument("--example", choices=("longest", "typical"), default="longest",
                        help="with --one-length, fit's example: a batch at --max-length (default), or at the "
                             "middle of the range, a batch as the loader gives one (the estimate is at its length)")
    parser.add_argument("--length-plan", default=None, metavar="LENGTHxSTEPS,...",
                        help="with --one-length, train these lengths in this order instead of random ones, e.g. "
                             "640x5,1024x4,640x4,600x5,320x4 (the first length runs training's static graph, the "
                             "rest the dynamic one; a length off the 64-token grid runs padded attention on CUDA); "
                             "--steps is then their sum")
    parser.add_argument("--no-cudnn-attention", action="store_true",
                        help="turn off cuDNN's attention for SDPA (torch.backends.cuda.enable_cudnn_sdp(False)) "
                             "before fit: cuDNN builds an execution plan for every new shape, which a step at a "
                             "new length would pay")
    parser.add_argument("--no-attention-buckets", action="store_true",
                        help="AUTOTUNE_ATTENTION_BUCKETS=0: attention runs at each batch's own length instead of "
                             "the length rounded up to a multiple of 64 (cuDNN then builds a plan per new length)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.length_plan:
        if not args.one_length:
            parser.error("--length-plan trains batches of one length each: add --one-length")
        args.steps = sum(steps for _, steps in _length_plan(args.length_plan))
    if args.no_attention_buckets:
        os.environ["AUTOTUNE_ATTENTION_BUCKETS"] = "0"
    if args.allocator == "fixed":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    low = args.min_length or args.max_length
    cap_memory(args.device, args.budget)
    model, example = build_gpt(args.model, args.device, args.max_length)
    hugging_face = hasattr(model, "config")  # the tiny GPT of the dry run takes no attention mask
    vocab = model.config.vocab_size if hugging_face else model.cfg.vocab_size
    if low < args.max_length and hugging_face and not args.one_length:
        example = padded_example(example["input_ids"].shape[0], low, args.max_length, vocab, args.device)
    if args.one_length and args.example == "typical":  # the middle length: the plan's estimate is at it
        example = {k: v[:, : (low + args.max_length) // 2] for k, v in example.items()}
    row: dict[str, Any] = {"model": args.model, "budget": args.budget, "lengths": [low, args.max_length],
                           "global_batch_size": args.global_batch_size, "steps": args.steps,
                           **environment(args.device)}
    started = time.perf_counter()
    plan = autotune.fit(model, example, global_batch_size=args.global_batch_size, memory_budget=args.budget,
                        device=args.device, cache=False, max_length=args.max_length)
    row.update(tune_s=round(time.perf_counter() - started, 1), plan=plan.summary(), reason=plan.reason,
               estimate_tokens_per_s=plan.tokens_per_second, mfu=plan.mfu, plan_peak=plan.peak_memory_bytes,
               estimate_at_length=(round(plan.tokens_per_second / plan.samples_per_second)
                                   if plan.tokens_per_second and plan.samples_per_second else None),
               failed_trials=[f"{t.rung.name} @ {t.micro_batch_size}: {t.outcome}: {t.note}" for t in plan.trials
                              if t.outcome in FAILED])  # a search that lost a configuration
    print(json.dumps(row), flush=True)
    if args.length_plan:
        data = planned_batches(args.length_plan, args.global_batch_size, vocab, args.device)
    else:
        data = batches(args.steps, args.global_batch_size, low, args.max_length, vocab, args.device, hugging_face,
                       args.length_multiple, args.one_length)
    frames_before, recompiles_before = _compiled_frames()
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    seconds, tokens, padded = [], [], []
    host: dict[str, list[float]] = {k: [] for k in ("tail_seconds", "chunks_before_tail", "chunks_total")}
    starts: list[Any] = []  # each micro-step's start on the device's timeline
    split: dict[str, list[Any]] = {"before_last": [], "last": []}
    hook = model.register_forward_pre_hook(_marking(starts, args.device), with_kwargs=True)
    with plan.apply(model, torch.optim.AdamW(model.parameters(), lr=1e-5)) as step:
        if isinstance(step.optimizer, (HostSteppedEngine, StreamedEngine)):  # what of the host step overlapped
            timed_optimizer(step, args.device, host)
        for batch in data:
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            starts.clear()
            t0 = time.perf_counter()
            step(batch)
            end = mark(args.device)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
            split["before_last"].append([round(seconds_between(a, b), 4) for a, b in zip(starts, starts[1:])])
            split["last"].append(round(seconds_between(starts[-1], end), 4) if starts else None)
            tokens.append(int((batch["labels"] != -100).sum()))
            padded.append(batch["labels"].numel())
        recoveries = len(step.recoveries)
    hook.remove()
    frames, recompiles = _compiled_frames()
    kept = slice(2, None) if len(seconds) > 2 else slice(None)
    limit = (1 - plan.margin) * parse_bytes(args.budget)
    reserved = torch.cuda.max_memory_reserved() if args.device.startswith("cuda") else None
    stats = torch.cuda.memory_stats() if args.device.startswith("cuda") else {}
    trained = sum(tokens[kept]) / sum(seconds[kept])
    trained_padded = sum(padded[kept]) / sum(seconds[kept])
    mean_length = sum(tokens) / len(tokens) / args.global_batch_size
    mean_padded = sum(padded) / len(padded) / args.global_batch_size
    first, again = _first_and_again(seconds[kept], [p // args.global_batch_size for p in padded][kept])
    row.update(trained_tokens_per_s=round(trained), trained_padded_tokens_per_s=round(trained_padded),
               mean_length=round(mean_length, 1), mean_padded_length=round(mean_padded, 1),
               trained_over_estimate=(round(trained_padded / plan.tokens_per_second, 3) if plan.tokens_per_second
                                      else None),
               graphs_compiled=frames - frames_before, recompiles=recompiles - recompiles_before,
               recoveries=recoveries, reserved_peak=reserved, limit=int(limit),
               reserved_within_margin=None if reserved is None else reserved <= limit,
               rss_gib=round(psutil.Process().memory_info().rss / 2**30, 2),
               allocator={k: stats.get(k) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")},
               allocator_setting=args.allocator, length_multiple=args.length_multiple,
               one_length=args.one_length, example=args.example, cudnn_attention=not args.no_cudnn_attention,
               attention_buckets=not args.no_attention_buckets,
               median_step_first_length=first, median_step_repeated_length=again,
               step_seconds=[round(x, 4) for x in seconds],
               micro_step_seconds=split["before_last"], last_micro_step_seconds=split["last"],
               optimizer_tail_seconds=[round(x, 4) for x in host["tail_seconds"]],
               chunks_before_tail=[int(c) for c in host["chunks_before_tail"]],
               chunks_total=[int(c) for c in host["chunks_total"]],
               padded_lengths=[p // args.global_batch_size for p in padded])
    print(json.dumps(row), flush=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
