"""A Llama-shaped decoder through `autotune.fit` and `plan.apply`, with the host's memory beside the GPU's.

Builds a decoder from a transformers `LlamaConfig` with random weights (FP32, on the GPU), caps the GPU at
`--budget` with `set_per_process_memory_fraction`, tunes with `autotune.fit` (public API only), then trains
`--steps` global steps of the plan. A thread samples the process's resident set and the machine's available
memory every 0.2 s; the result line gives both peaks beside the GPU's, the tune time, the plan and its MFU.

    python benchmarks/bench_llama.py --size 3b --budget 24GiB --global-batch-size 32 --steps 20 --out llama.jsonl
    python benchmarks/bench_llama.py --size 1b --budget 24GiB --steps 20 --out llama.jsonl
    python benchmarks/bench_llama.py --size tiny --device cpu --budget 200MiB --seq 64 --steps 2 --out x.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import psutil
import torch

# (hidden, layers, heads, kv heads, intermediate, vocabulary): TinyLlama 1.1B, Llama 3.2 1B and 3B, Llama 3 8B,
# and a tiny one
SIZES = {
    "tiny": (128, 4, 4, 2, 256, 1024),
    "1.1b": (2048, 22, 32, 4, 5632, 32000),
    "1b": (2048, 16, 32, 8, 8192, 128256),
    "3b": (3072, 28, 24, 8, 8192, 128256),
    "8b": (4096, 32, 32, 8, 14336, 128256),
}


class HostSampler:
    """Peaks of this process's RSS and the machine's lowest available memory, sampled on a thread."""

    def __init__(self, every_s: float = 0.2) -> None:
        self.every_s, self.rss_peak, self.available_low = every_s, 0, psutil.virtual_memory().available
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            self.rss_peak = max(self.rss_peak, me.memory_info().rss)
            self.available_low = min(self.available_low, psutil.virtual_memory().available)
            self._stop.wait(self.every_s)

    def __enter__(self) -> HostSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def build(size: str, seq: int, device: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, inter, vocab = SIZES[size]
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                      max_position_embeddings=max(seq, 2048), attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: seconds, where a CPU init of 3B takes minutes
        model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, vocab, (4, seq), device=device)
    return model, {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="3b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--budget", default="24GiB", help="GPU memory cap and fit's memory_budget")
    parser.add_argument("--host-budget", default=None, help="fit's host_memory_budget (default: fit's own)")
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import autotune
    from autotune.sizes import parse_bytes

    if args.device.startswith("cuda"):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_bytes(args.budget) / total))
    model, batch = build(args.size, args.seq, args.device)
    params = sum(p.numel() for p in model.parameters())
    row: dict[str, Any] = {"size": args.size, "parameters": params, "seq": args.seq, "budget": args.budget,
                           "global_batch_size": args.global_batch_size, "device": args.device,
                           "host_total_gib": round(psutil.virtual_memory().total / 2**30, 1)}
    if args.device.startswith("cuda"):
        row["gpu"] = torch.cuda.get_device_name(0)
    with HostSampler() as host:
        start = time.perf_counter()
        plan = autotune.fit(model, batch, global_batch_size=args.global_batch_size, memory_budget=args.budget,
                            device=args.device, cache=False, host_memory_budget=args.host_budget)
        row["tune_s"] = round(time.perf_counter() - start, 1)
        row.update(plan=plan.summary(), reason=plan.reason, mfu=plan.mfu, trials=len(plan.trials),
                   estimate_tokens_per_s=plan.tokens_per_second, plan_host_peak_gib=_gib(plan.host_peak_bytes),
                   tune_rss_peak_gib=_gib(host.rss_peak),
                   trial_table=[[t.rung.name, t.micro_batch_size, t.outcome, round(t.samples_per_second, 2),
                                 _gib(t.peak_bytes), _gib(t.host_peak_bytes), t.note] for t in plan.trials],
                   phase_totals=_phase_totals(plan.trials),
                   outside_trials={k: round(v, 1) for k, v in plan.evidence.tune_phases.items()},
                   trial_phases=[{k: round(v, 1) for k, v in t.phases.items()} for t in plan.trials])
        print(json.dumps(row), flush=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        step = plan.apply(model, optimizer)
        ids = torch.randint(0, model.config.vocab_size, (args.global_batch_size, args.seq), device=args.device)
        times, losses = [], []
        for _ in range(args.steps):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = step({"input_ids": ids, "labels": ids})
            losses.append(float(loss))
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    median = statistics.median(times[2:] or times)
    tokens_per_s = args.global_batch_size * args.seq / median
    row.update(steps=args.steps, trained_tokens_per_s=round(tokens_per_s), last_loss=losses[-1],
               recoveries=len(getattr(step, "recoveries", ()) or ()), plan_after=step.plan.summary(),
               trained_mfu=(plan.mfu * tokens_per_s / plan.tokens_per_second
                            if plan.mfu and plan.tokens_per_second else None),
               rss_peak_gib=_gib(host.rss_peak), available_low_gib=_gib(host.available_low),
               host_peak_fraction=round(1 - host.available_low / psutil.virtual_memory().total, 3))
    if args.device.startswith("cuda"):
        row["gpu_reserved_peak_gib"] = _gib(torch.cuda.max_memory_reserved())
    print(json.dumps(row), flush=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")


def _phase_totals(trials: Any) -> dict[str, float]:
    """Seconds per phase summed over the tune's trials (where a tune's time went)."""
    totals: dict[str, float] = {}
    for t in trials:
        for name, seconds in t.phases.items():
            totals[name] = totals.get(name, 0.0) + seconds
    return {name: round(seconds, 1) for name, seconds in totals.items()}


def _gib(n: int | None) -> float | None:
    return None if n is None else round(n / 2**30, 2)


if __name__ == "__main__":
    main()
