"""bf16 against fp8 on one configuration: loss curves and tokens/s of the same training, with and without
torchao's float8 linear layers.

Builds a Llama-shaped decoder (transformers' `LlamaConfig`, random weights, FP32 on the GPU: every projection
an `nn.Linear` whose features divide by 16) or, with `--size gpt2-large`, transformers' GPT-2 large (its
attention and MLP `Conv1D` layers), tunes it with `autotune.fit(..., techniques=(..., "fp8"))`, then
trains `--steps` global steps twice from the same weights and the same batches: once on the plan with fp8,
once on the same plan without it (`plan.with_config(fp8=False)`), so float8 is the only difference. The data
is a learnable stream (each sequence repeats a random prefix), so the loss falls and the two curves can be
compared. Tokens/s is the median over the steps after `--warmup`, the GPU synchronized around each step.
Where the search left fp8 out (the reason says why) or chose the plan without it, both runs still train: the
fp8 one on the tuned configuration with fp8 turned on.

    python benchmarks/bench_fp8.py --size 1b --budget 40GiB --global-batch-size 32 --seq 1024 --steps 200 \\
        --out fp8.json
    python benchmarks/bench_fp8.py --size tiny --seq 256 --steps 30 --out /tmp/fp8.json    # a quick check
    python benchmarks/bench_fp8.py --size 1.1b --seq 2048 --budget 24GiB --global-batch-size 32 --steps 200 \\
        --roof-micro 8 --out fp8_1b.json                 # beside the uncapped compiled bf16 roof, same batches
    python benchmarks/bench_fp8.py --size gpt2-large --seq 1024 --budget 24GiB --global-batch-size 64 \\
        --steps 200 --roof-micro 8 --out fp8_w1.json     # W1

Needs a CUDA GPU of compute capability 8.9 or later and torchao (`pip install -e ".[fp8]"`). Writes one JSON
object: the plan and its reason, and per run ("bf16", "fp8") the loss of every step, the step seconds and
tokens/s; `fp8_over_bf16` is the ratio of the two rates and `final_loss_gap` the difference of the mean loss
over the last tenth of the steps. With `--roof-micro`, a third run, "roof", trains the same steps as plain
compiled bf16 without the budget, first, and `fp8_over_roof` and `final_loss_gap_to_roof` hold the fp8 plan
against it.
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

from workloads import cap_memory, environment

import autotune

# (hidden, layers, heads, kv heads, intermediate, vocabulary)
SIZES = {
    "tiny": (256, 4, 4, 2, 768, 4096),
    "350m": (1024, 24, 16, 8, 2816, 32000),
    "1b": (2048, 16, 32, 8, 8192, 128256),
    "1.1b": (2048, 22, 32, 4, 5632, 32000),  # TinyLlama's shape, as bench_llama.py builds it
    "3b": (3072, 28, 24, 8, 8192, 128256),
}


GPT2 = {"gpt2-large": (1280, 36, 20)}  # (hidden, layers, heads): transformers' GPT-2, its layers `Conv1D`


def build(size: str, seq: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if size in GPT2:
        hidden, layers, heads = GPT2[size]
        torch.manual_seed(0)
        with torch.device("cuda"):
            return GPT2LMHeadModel(GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=seq,
                                              use_cache=False))
    hidden, layers, heads, kv, inter, vocab = SIZES[size]
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                      max_position_embeddings=seq, use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaForCausalLM(cfg)


def batch(n: int, seq: int, vocab: int, step: int) -> dict[str, torch.Tensor]:
    """`n` sequences, each a random prefix of seq/4 tokens repeated: the repeats are learnable."""
    g = torch.Generator().manual_seed(step)
    prefix = torch.randint(0, vocab, (n, seq // 4), generator=g)
    ids = prefix.repeat(1, 4)[:, :seq].contiguous().cuda()
    return {"input_ids": ids, "labels": ids}


def train(plan: Any, model: torch.nn.Module, start: dict[str, torch.Tensor], args: argparse.Namespace,
          vocab: int) -> dict[str, Any]:
    """`args.steps` global steps of `plan` from the weights `start`; the loss and seconds of each."""
    model.load_state_dict(start)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    losses, seconds = [], []
    with plan.apply(model, optimizer) as step:
        for i in range(args.steps):
            data = batch(args.global_batch_size, args.seq, vocab, i)
            torch.cuda.synchronize()
            began = time.perf_counter()
            loss = step(data)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - began)
            losses.append(float(loss))
    return summary(plan.rung.name, losses, seconds, args)


def summary(rung: str, losses: list[float], seconds: list[float], args: argparse.Namespace) -> dict[str, Any]:
    """A run's record: its losses and step seconds, the median step after the warm-up and its tokens/s, and the
    mean loss over the last tenth of the steps."""
    median = statistics.median(seconds[args.warmup:] or seconds)
    tail = max(1, args.steps // 10)
    return {"rung": rung, "losses": losses, "step_seconds": seconds, "median_step_seconds": median,
            "tokens_per_second": args.global_batch_size * args.seq / median,
            "final_loss": statistics.mean(losses[-tail:])}


def roof(model: torch.nn.Module, start: dict[str, torch.Tensor], args: argparse.Namespace,
         vocab: int) -> dict[str, Any]:
    """The bf16 roof over the same steps and batches: the model compiled whole, bf16 autocast, fused AdamW,
    `args.roof_micro` samples a micro-batch accumulated to the global batch, no memory cap and no autotune."""
    model.load_state_dict(start)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    compiled = torch.compile(model)
    micro = args.roof_micro
    steps_per = max(1, args.global_batch_size // micro)
    losses, seconds = [], []
    for i in range(args.steps):
        data = batch(args.global_batch_size, args.seq, vocab, i)
        torch.cuda.synchronize()
        began = time.perf_counter()
        total = torch.zeros((), device="cuda")
        for m in range(steps_per):
            part = {k: v[m * micro:(m + 1) * micro] for k, v in data.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(**part).loss / steps_per
            loss.backward()
            total += loss.detach()  # no synchronising read inside the timed step
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - began)
        losses.append(float(total))
    peak = torch.cuda.max_memory_reserved()
    del optimizer, compiled
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return {**summary(f"compiled bf16 (whole model), {micro} x {steps_per}, uncapped", losses, seconds, args),
            "peak_reserved": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES) + sorted(GPT2), default="tiny")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--budget", default=None, help="memory budget (e.g. 40GiB); default the whole GPU")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the rate (compile, first shapes)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--techniques", default="bf16,checkpointing,offload,compile,chunked_loss,fp8")
    parser.add_argument("--roof-micro", type=int, default=None,
                        help="also train the bf16 roof (the model compiled whole, uncapped) at this micro-batch, "
                             "before the budget is set, over the same steps and batches")
    parser.add_argument("--runs", default="bf16,fp8",
                        help="which of the plan's runs to train: bf16 (fp8 off), fp8, or both (the default); with "
                             "--roof-micro, fp8 alone holds the fp8 plan to the roof in half the time")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8 needs a CUDA GPU")
    model = build(args.size, args.seq)
    vocab = model.config.vocab_size
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ceiling = roof(model, start, args, vocab) if args.roof_micro else None
    if args.budget:
        cap_memory("cuda", args.budget)
    tuned_at = time.perf_counter()
    plan = autotune.fit(model, batch(min(4, args.global_batch_size), args.seq, vocab, -1),
                        global_batch_size=args.global_batch_size, memory_budget=args.budget, cache=False,
                        techniques=tuple(args.techniques.split(",")))
    tune_seconds = time.perf_counter() - tuned_at
    wanted = args.runs.split(",")
    runs = {name: train(plan.with_config(fp8=name == "fp8"), model, start, args, vocab)
            for name in ("bf16", "fp8") if name in wanted}
    result = {"environment": environment("cuda"), "size": args.size, "seq": args.seq,
              "global_batch_size": args.global_batch_size, "steps": args.steps, "tune_seconds": tune_seconds,
              "plan": plan.summary(), "plan_fp8": plan.fp8, "reason": plan.reason, "runs": runs}
    if "bf16" in runs and "fp8" in runs:
        result["fp8_over_bf16"] = runs["fp8"]["tokens_per_second"] / runs["bf16"]["tokens_per_second"]
        result["final_loss_gap"] = runs["fp8"]["final_loss"] - runs["bf16"]["final_loss"]
    if ceiling is not None:
        runs["roof"] = ceiling
    if ceiling is not None and "fp8" in runs:  # the fp8 plan at its budget against the uncapped roof, and the loss
        result["fp8_over_roof"] = runs["fp8"]["tokens_per_second"] / ceiling["tokens_per_second"]
        result["final_loss_gap_to_roof"] = runs["fp8"]["final_loss"] - ceiling["final_loss"]
        result["final_loss_gap_to_roof_relative"] = result["final_loss_gap_to_roof"] / ceiling["final_loss"]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    for name, run in runs.items():
        print(f"{name}: {run['rung']}, {run['tokens_per_second']:,.0f} tok/s, final loss {run['final_loss']:.4f}")


if __name__ == "__main__":
    main()
