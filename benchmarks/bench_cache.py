"""A plan-cache hit beside a cold tune of the same workload.

Each measurement runs in a fresh process (`--role`), timed inside it around the `autotune.fit` call only
(interpreter start and `import torch` excluded): a cold tune on an empty cache file, then hits on the file
the last cold tune left: the first `fit` of a new process (what a second training run pays), then repeated
`fit` calls in one process, then the parts of a hit: opening the cache, computing the key, the lookup.

    python benchmarks/bench_cache.py                                   # CPU, simulated 40 MiB ceiling
    python benchmarks/bench_cache.py --cold 3 --hits 5 --out cache.jsonl
    python benchmarks/bench_cache.py --device cuda --budget 24GiB --layers 24 --width 1024 --seq 1024

The workload is the examples' GPT (random weights, AdamW, global batch --global-batch-size).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

from gpt import GPT, GPTConfig, random_batch  # noqa: E402

import autotune  # noqa: E402
from autotune import parallel as distributed  # noqa: E402
from autotune.cache import store as plan_cache  # noqa: E402
from autotune.devices.placement import resolve_device  # noqa: E402
from autotune.sizes import parse_bytes  # noqa: E402
from autotune.techniques import parse_techniques  # noqa: E402

REPEATS_IN_PROCESS = 50


def workload(args: argparse.Namespace) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.width, seq_len=args.seq, n_head=max(1, args.width // 32))
    model = GPT(cfg).to(args.device)
    batch = tuple(t.to(args.device) for t in random_batch(cfg, 8, torch.Generator().manual_seed(0)))
    return model, batch


def timed_fit(args: argparse.Namespace, model: torch.nn.Module, batch: Any) -> tuple[float, autotune.Plan]:
    started = time.perf_counter()
    plan = autotune.fit(model, batch, global_batch_size=args.global_batch_size, memory_budget=args.budget,
                        device=args.device, cache=args.cache)
    return time.perf_counter() - started, plan


def role_cold(args: argparse.Namespace) -> dict[str, Any]:
    model, batch = workload(args)
    seconds, plan = timed_fit(args, model, batch)
    return {"role": "cold", "seconds": seconds, "source": plan.source, "trials_run": _trials_run(plan),
            "plan": plan.summary()}


def role_hit(args: argparse.Namespace) -> dict[str, Any]:
    model, batch = workload(args)
    first, plan = timed_fit(args, model, batch)
    repeats = [timed_fit(args, model, batch)[0] for _ in range(REPEATS_IN_PROCESS)]
    return {"role": "hit", "first_seconds": first, "repeat_seconds": repeats, "source": plan.source,
            "trials_run": _trials_run(plan), "plan": plan.summary(), **hit_parts(args, model, batch)}


def _trials_run(plan: autotune.Plan) -> int:
    return 0 if plan.source == "cache" else len(plan.trials)  # a hit carries the trials of the tune behind it


def hit_parts(args: argparse.Namespace, model: torch.nn.Module, batch: Any) -> dict[str, list[float]]:
    """The three steps of a hit, each timed alone: open the file, compute the key, look it up."""
    placement = resolve_device(args.device)
    opened, keyed, looked = [], [], []
    for _ in range(REPEATS_IN_PROCESS):
        t0 = time.perf_counter()
        store = plan_cache.open_cache(args.cache)
        t1 = time.perf_counter()
        parts = plan_cache.key_parts(model=model, batch=batch, global_batch_size=args.global_batch_size,
                                     world_size=distributed.world_size(), placement=placement,
                                     budget_bytes=parse_bytes(args.budget), techniques=parse_techniques(None),
                                     margin=0.1)
        key = plan_cache.plan_key(parts)
        t2 = time.perf_counter()
        assert store is not None and store.get(key) is not None, "the lookup missed: the key differs from fit's"
        t3 = time.perf_counter()
        opened.append(t1 - t0)
        keyed.append(t2 - t1)
        looked.append(t3 - t2)
        store.close()
    return {"open_seconds": opened, "key_seconds": keyed, "get_seconds": looked}


def child(args: argparse.Namespace, role: str, cache: str) -> dict[str, Any]:
    argv = [sys.executable, os.path.abspath(__file__), "--role", role, "--cache", cache, "--device", args.device,
            "--budget", args.budget, "--layers", str(args.layers), "--width", str(args.width), "--seq",
            str(args.seq), "--global-batch-size", str(args.global_batch_size)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main_run(args: argparse.Namespace) -> None:
    colds, hits = [], []
    for _ in range(args.cold):
        cache = os.path.join(tempfile.mkdtemp(prefix="bench-cache-"), "plans.db")  # empty: a cold tune
        colds.append(child(args, "cold", cache))
        print(f"cold tune: {colds[-1]['seconds']:.2f} s, {colds[-1]['trials_run']} trials", file=sys.stderr)
    for _ in range(args.hits):
        hits.append(child(args, "hit", cache))  # the file the last cold tune wrote
        print(f"hit: first {hits[-1]['first_seconds'] * 1e3:.1f} ms", file=sys.stderr)
    record = {"command": " ".join(["python", "benchmarks/bench_cache.py", *sys.argv[1:]]), "machine": machine(),
              "workload": vars(args) | {"cache": None}, "cold": colds, "hits": hits}
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    print(table(record))


def table(record: dict[str, Any]) -> str:
    colds, hits = record["cold"], record["hits"]
    rows = [("cold tune, empty cache (new process)", [c["seconds"] for c in colds],
             _span(c["trials_run"] for c in colds)),
            ("cache hit, first fit of a new process", [h["first_seconds"] for h in hits],
             _span(h["trials_run"] for h in hits)),
            ("cache hit, repeated in one process", [s for h in hits for s in h["repeat_seconds"]], "0"),
            ("  of which: open the cache file", [s for h in hits for s in h["open_seconds"]], None),
            ("  of which: key (fingerprint, hash)", [s for h in hits for s in h["key_seconds"]], None),
            ("  of which: lookup (get)", [s for h in hits for s in h["get_seconds"]], None)]
    lines = [f"workload: GPT {record['workload']['layers']} layers, width {record['workload']['width']}, seq "
             f"{record['workload']['seq']}, global batch {record['workload']['global_batch_size']}, "
             f"{record['workload']['device']} budget {record['workload']['budget']}",
             f"plan: {colds[-1]['plan']}", f"machine: {record['machine']}", f"command: {record['command']}", "",
             "| measurement | runs | median | min | max | trials run |", "|---|---|---|---|---|---|"]
    for name, values, trials in rows:
        lines.append(f"| {name} | {len(values)} | {_t(statistics.median(values))} | {_t(min(values))} | "
                     f"{_t(max(values))} | {'' if trials is None else trials} |")
    speedup = statistics.median(rows[0][1]) / statistics.median(rows[1][1])
    lines.append(f"\nfirst hit of a new process: {speedup:,.0f}x faster than the cold tune (medians); "
                 "the hit returns the same plan, source='cache'")
    if any(h["source"] != "cache" for h in hits):
        lines.append("WARNING: a 'hit' run tuned instead (cache miss): the key is not stable across processes")
    return "\n".join(lines)


def machine() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()}-core {platform.machine()} CPU, {gpu}; {platform.system()} {platform.release()}; "
            f"Python {platform.python_version()}, torch {torch.__version__}; load average "
            f"{os.getloadavg()[0]:.1f} at the end")


def _span(values: Any) -> str:
    values = sorted(values)
    return str(values[0]) if values[0] == values[-1] else f"{values[0]}-{values[-1]}"


def _t(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.2f} ms"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budget", default="40MiB", help="memory budget (the simulated ceiling on the CPU)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--cold", type=int, default=3, help="cold tunes, each in a new process on an empty cache")
    parser.add_argument("--hits", type=int, default=5, help="new processes that hit the cache")
    parser.add_argument("--out", help="append the raw timings as one JSON line to this file")
    parser.add_argument("--role", choices=["cold", "hit"], help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.role:
        print(json.dumps(role_cold(arguments) if arguments.role == "cold" else role_hit(arguments)))
    else:
        main_run(arguments)
