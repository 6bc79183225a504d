"""A Mixtral-style mixture of experts (8 experts, top-2, router loss on) trained by autotune's plan at a tight
budget beside an unsplit PyTorch reference over the same batches: does the loss curve match?

    python benchmarks/bench_moe.py --out benchmarks/data/moe               # one H200: under 90 s in all
    python benchmarks/bench_moe.py --device cpu --tiny --out /tmp/moe      # the simulated ceiling, seconds

The model is transformers' `MixtralForCausalLM` from a config (random weights, a tiny vocabulary so that the
experts, not the head, hold the activations) with `output_router_logits=True` and the default
`router_aux_loss_coef`: its loss is the token cross-entropy plus the load-balancing loss of the batch's
routing. Both runs start from the same weights and see the same `--steps` global batches (token sequences
with a learnable stride), under bf16 autocast, with AdamW:

- reference: plain PyTorch, the whole global batch in one forward and one backward per step. Its second
  step's peak (the first meets no AdamW state), measured as autotune's trials measure (the caching
  allocator's reserved bytes and what the process holds outside it; the simulated ceiling on the CPU), sets
  the budget: `--budget-share` of it, tight enough that recomputing every block does not fit the whole batch;
- autotune: `autotune.fit(..., memory_budget=that, cache=False)` (`AUTOTUNE_CACHE=off`), then `plan.apply`
  trains the steps. The budget leaves the whole batch no room, so the plan accumulates micro-batches, and
  the router loss becomes the share-weighted mean of the micro-batches' values; the script exits 1 when
  the plan does not split the batch (raise --global-batch-size or lower --budget-share).

compile is left out of the search (`--techniques`): compiling alone would take most of the time allowed.
Prints a table (step, autotune loss, reference loss) and writes `bench_moe.json` under `--out`: both curves,
the plan, the budget, the peaks, the host's resident set (psutil) and `free -g`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import environment

import autotune
from autotune.devices.placement import MemoryMeter, resolve_device

# hidden, layers, attention heads, kv heads, expert width, vocabulary, tokens per sample, global batch
SIZES = {
    "gpu": (256, 4, 4, 2, 512, 256, 512, 64),
    "tiny": (16, 2, 2, 2, 16, 32, 64, 16),
}
TECHNIQUES = "bf16,checkpointing,offload,chunked_loss"
MEASURED = 1  # the reference step whose peak sets the budget


def build(size: str, device: str, seed: int, experts: str | None) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    hidden, layers, heads, kv_heads, width, vocab, seq, _ = SIZES[size]
    config = MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=width, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq,
                           num_local_experts=8, num_experts_per_tok=2, output_router_logits=True,
                           **({"experts_implementation": experts} if experts else {}))
    torch.manual_seed(seed)
    return MixtralForCausalLM(config).to(device)


def batches(steps: int, n: int, seq: int, vocab: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """`steps` global batches of `n` sequences (a + b t) mod vocab, a and b drawn per sample: a pattern the
    model can learn within the run, so the curves fall and a mismatch shows as a gap."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        ids = (start + stride * torch.arange(seq)) % vocab
        out.append({"input_ids": ids, "labels": ids})
    return out


def reference(model: torch.nn.Module, data: list[dict[str, torch.Tensor]], device: str,
              lr: float) -> dict[str, Any]:
    """The whole global batch in one forward per step; the second step's peak as a trial measures it (the
    first builds AdamW's state after its backward, so only from the second on do both meet)."""
    placement = resolve_device(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    meter = MemoryMeter(placement, 2**60)
    losses, seconds, peak = [], [], 0
    for i, batch in enumerate(data):
        t0 = time.perf_counter()
        on_device = {k: v.to(device) for k, v in batch.items()}
        with meter.watching(model, optimizer, on_device) if i == MEASURED else contextlib.nullcontext():
            with torch.autocast(placement.torch_device.type, dtype=torch.bfloat16):
                loss = model(**on_device).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if i == MEASURED:
                peak = meter.read().peak_bytes
        losses.append(loss.item())
        seconds.append(time.perf_counter() - t0)
    return {"losses": losses, "step_seconds": seconds, "peak_bytes": peak}


def tuned(model: torch.nn.Module, data: list[dict[str, torch.Tensor]], args: argparse.Namespace,
          budget: int) -> dict[str, Any]:
    """`autotune.fit` at `budget` on the first batch, then `plan.apply` trains every batch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    t0 = time.perf_counter()
    plan = autotune.fit(model, data[0], optimizer=optimizer, global_batch_size=len(data[0]["input_ids"]),
                        memory_budget=budget, device=args.device, cache=False, progress=False,
                        techniques=tuple(args.techniques.split(",")), trial_steps=args.trial_steps,
                        max_trials=args.max_trials)
    tune_seconds = time.perf_counter() - t0
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()  # what the trials left reserved is not the training's
        torch.cuda.reset_peak_memory_stats()
    losses, seconds, peaks = [], [], []
    with plan.apply(model, optimizer) as step:
        for batch in data:
            t0 = time.perf_counter()
            losses.append(step(batch))
            seconds.append(time.perf_counter() - t0)
            peaks.append(step.last_peak_bytes)
        recoveries = [r.note for r in step.recoveries]
        trained = step.plan.summary()
    cuda = args.device.startswith("cuda")
    peak = torch.cuda.max_memory_reserved() if cuda else max(p or 0 for p in peaks)  # simulated: the ceiling's
    return {"losses": losses, "step_seconds": seconds, "tune_seconds": tune_seconds, "trials": len(plan.trials),
            "plan": plan.summary(), "reason": plan.reason, "plan_record": plan.to_dict(), "trained_as": trained,
            "accumulation_steps": plan.accumulation_steps, "micro_batch_size": plan.micro_batch_size,
            "plan_peak_bytes": plan.peak_memory_bytes, "peak_bytes": int(peak),
            "allocated_peak_bytes": torch.cuda.max_memory_allocated() if cuda else int(peak),
            "recoveries": recoveries}


def host() -> dict[str, Any]:
    """This process's resident set now and at its peak, and the machine's `free -g`."""
    try:
        free = subprocess.run(["free", "-g"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        free = f"free -g failed: {exc}"
    return {"rss_bytes": psutil.Process().memory_info().rss,
            "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
            "free_g": free}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny size (with --device cpu: seconds)")
    parser.add_argument("--steps", type=int, default=None, help="default 20 (--tiny: 5)")
    parser.add_argument("--global-batch-size", type=int, default=None, help="default: the size's")
    parser.add_argument("--budget-share", type=float, default=0.35,
                        help="memory_budget as a share of the reference's full-batch peak")
    parser.add_argument("--techniques", default=TECHNIQUES)
    parser.add_argument("--trial-steps", type=int, default=2)
    parser.add_argument("--max-trials", type=int, default=None, help="fit's max_trials; default fit's")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--experts", default=None, help="experts_implementation; default transformers' choice")
    parser.add_argument("--out", required=True, help="directory for bench_moe.json")
    args = parser.parse_args(argv)
    size = "tiny" if args.tiny else "gpu"
    if args.tiny:  # seconds on a CPU, where the simulated ceiling watches every operator of trials and steps
        args.steps = args.steps or 5
    args.steps = args.steps or 20
    if args.device == "cpu":
        # The tiny model's operators are too small to share out: threads waiting on each other on a busy
        # machine cost more than they compute.
        torch.set_num_threads(1)
    n = args.global_batch_size or SIZES[size][7]
    model = build(size, args.device, args.seed, args.experts)
    initial = copy.deepcopy(model.state_dict())
    config = model.config
    data = batches(args.steps, n, SIZES[size][6], config.vocab_size, args.seed + 1)

    ref = reference(model, data, args.device, args.lr)
    model.load_state_dict(initial)  # the same start for autotune; AdamW's state is new, as in the reference
    del initial
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    budget = int(args.budget_share * ref["peak_bytes"])
    tune = tuned(model, data, args, budget)

    print(f"{'step':>4}  {'autotune':>10}  {'reference':>10}")
    for i, (a, r) in enumerate(zip(tune["losses"], ref["losses"])):
        print(f"{i:4d}  {a:10.4f}  {r:10.4f}")
    gaps = [abs(a - r) / abs(r) for a, r in zip(tune["losses"], ref["losses"])]
    print(f"plan: {tune['plan']}\nbudget {budget:,} bytes ({args.budget_share:.0%} of the full batch's "
          f"{ref['peak_bytes']:,}); largest relative gap {max(gaps):.2%}", flush=True)
    record = {"args": vars(args), "size": size, "global_batch_size": n, "tokens_per_sample": SIZES[size][6],
              "parameters": sum(p.numel() for p in model.parameters()),
              "model": {"experts": config.num_local_experts, "top_k": config.num_experts_per_tok,
                        "router_aux_loss_coef": config.router_aux_loss_coef, "vocab_size": config.vocab_size,
                        "experts_implementation": getattr(config, "_experts_implementation", None)},
              "budget_bytes": budget, "reference": ref, "autotune": tune, "relative_gaps": gaps,
              "host": host(), "environment": environment(args.device),
              "seconds_since_start": time.time() - psutil.Process().create_time()}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_moe.json"), "w") as f:
        json.dump(record, f, indent=1)
    if tune["accumulation_steps"] < 2:
        print(f"the plan trains the whole batch at once ({tune['plan']}): nothing was split; raise "
              "--global-batch-size or lower --budget-share", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
