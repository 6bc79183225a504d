"""The model zoo on a GPU: each tiny Hugging Face family trained 20 steps with `fit`'s own plan (bf16 and compile
allowed, micro-batches of at most 3 of the 8 samples) against the plain bf16 autocast step on the whole batch.

The yardstick is bf16's own noise: the same plain step in fp32. A family passes where its plan's losses stay as
close to the plain bf16 step's as the plain bf16 step's stay to fp32's (at most 2x that gap, and never more than 2%
where the gap is smaller); families whose loss autotune says it cannot reproduce (a MoE's router loss, BatchNorm's
statistics) are listed with their reason. One process per family, eight at a time, so compiles overlap.

    python benchmarks/check_zoo_gpu.py --out zoo.jsonl            # every family
    python benchmarks/check_zoo_gpu.py --families gpt2_lm,t5_seq2seq
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20
MAX_MICRO_BATCH = "3"
LR = 1e-3
DEVICE = os.environ.get("ZOO_DEVICE", "cuda")  # "cpu" for a smoke run of this script without a GPU


def train_plain(model, batch, dtype):  # type: ignore[no-untyped-def]
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def _gap(got: list[float], want: list[float]) -> float:
    """The largest relative gap between two loss curves; inf where either holds a NaN or an infinity (a
    plain max would skip a NaN)."""
    if not all(math.isfinite(x) for x in [*got, *want]):
        return math.inf
    return max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(got, want))


def one_family(name: str) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    import zoo_models

    import autotune

    family = next(f for f in zoo_models.FAMILIES if f.name == name)
    model64, batch64 = family.build()
    model = model64.float().to(DEVICE)
    batch = {k: (v.float() if v.is_floating_point() else v).to(DEVICE) for k, v in batch64.items()}
    fp32_losses = train_plain(copy.deepcopy(model), batch, "fp32")
    bf16_losses = train_plain(copy.deepcopy(model), batch, "bf16")
    started = time.perf_counter()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    plan = autotune.fit(model, batch, global_batch_size=zoo_models.N, optimizer=optimizer, device=DEVICE,
                        techniques=("bf16", "checkpointing", "compile", "chunked_loss"), trial_steps=2)
    tune_seconds = time.perf_counter() - started
    step = plan.apply(model, optimizer)
    plan_losses = [float(step(batch)) for _ in range(STEPS)]
    noise = _gap(bf16_losses, fp32_losses)
    off = _gap(plan_losses, bf16_losses)
    return {"family": name, "task": family.task, "plan": plan.summary().split(";")[0], "reason": plan.reason,
            "micro_batch": plan.micro_batch_size, "accumulation": plan.accumulation_steps,
            "compile": plan.compile, "precision": plan.precision, "tune_s": round(tune_seconds, 1),
            "loss_first": plan_losses[0], "loss_last": plan_losses[-1], "bf16_last": bf16_losses[-1],
            "fp32_last": fp32_losses[-1], "bf16_noise": noise, "plan_vs_bf16": off,
            "finite": math.isfinite(off), "within_noise": off <= max(2 * noise, 0.02)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="", help="comma-separated names (default: all)")
    parser.add_argument("--out", default="zoo_gpu.jsonl")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # a worker: one family, JSON on stdout
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one_family(args.one)))
        return 0
    sys.path.insert(0, str(ROOT / "tests"))
    import zoo_models

    names = [n for n in args.families.split(",") if n] or [f.name for f in zoo_models.FAMILIES]
    # One plan cache for every family, fresh for this run, as a team shares one: concurrent writers included.
    cache = Path(args.out).with_suffix(".cache.db")
    cache.unlink(missing_ok=True)
    env = {**os.environ, "AUTOTUNE_MAX_MICRO_BATCH": MAX_MICRO_BATCH, "AUTOTUNE_CACHE": str(cache)}

    def run(name: str) -> dict:
        done = subprocess.run([sys.executable, __file__, "--one", name], env=env, capture_output=True, text=True,
                              timeout=900)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if lines:
            return json.loads(lines[-1][len("RESULT "):])
        return {"family": name, "error": (done.stderr or done.stdout)[-1500:]}

    rows = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool, open(args.out, "w") as out:
        for done in concurrent.futures.as_completed([pool.submit(run, name) for name in names]):
            rows.append(done.result())
            out.write(json.dumps(rows[-1]) + "\n")  # each as it ends: a run cut short keeps what finished
            out.flush()
    rows.sort(key=lambda r: names.index(r["family"]))
    print(f"{'family':26} {'plan':34} {'m x a':>6} {'loss@20':>8} {'bf16':>8} {'noise':>7} {'off':>7}  ok")
    for r in rows:
        if "error" in r:
            print(f"{r['family']:26} ERROR {r['error'].strip().splitlines()[-1][:90]}")
            continue
        print(f"{r['family']:26} {r['plan'][:34]:34} {r['micro_batch']:>2}x{r['accumulation']:<3} "
              f"{r['loss_last']:8.4f} {r['bf16_last']:8.4f} {r['bf16_noise']:7.4f} {r['plan_vs_bf16']:7.4f}  "
              f"{'yes' if r['within_noise'] else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
