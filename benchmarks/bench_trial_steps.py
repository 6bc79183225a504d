"""Does a trial's estimate depend on how long it warms up and measures? A trial that prices one configuration
under what it trains and another over can make the search pick the slower one.

For each configuration (`--config RUNG_JSON@MICRO`, repeatable; default: W3's candidates), in one process:
the trial runner's estimate with (warm-up, measured) steps of each `--steps-pair`, then `--train` steps of
the plain training loop bench_peers verifies with. Prints estimate / trained per pair, and appends JSON lines.

    python benchmarks/bench_trial_steps.py --workload W3 --out steps.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workloads as wl

from autotune.plan import Rung

W3_CONFIGS = ('{}@64', '{}@86', '{"checkpointing": "selective", "checkpointed_blocks": 11}@128',
              '{"compile": true}@64')


def parse_config(text: str) -> tuple[Rung, int, float]:
    """RUNG_JSON@MICRO[@SHARE]: SHARE is the optimizer-offload fraction (1 when left out)."""
    rung, _, rest = text.partition("@")
    micro, _, share = rest.partition("@")
    return Rung(**json.loads(rung)), int(micro), float(share or 1.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="W3", choices=sorted({**wl.WORKLOADS, **wl.EXTRA}))
    p.add_argument("--config", action="append", default=[],
                   help="RUNG_JSON@MICRO[@SHARE], e.g. '{\"compile\": true}@64' "
                   "or '{\"offload\": \"optimizer\"}@6@0.65'")
    p.add_argument("--steps-pair", action="append", default=[], help="WARMUP,MEASURED (default 1,3 and 3,10)")
    p.add_argument("--train", type=int, default=20, help="training steps after the trials (the first is not timed)")
    p.add_argument("--smoke", action="store_true", help="the CPU stand-in of the workload (to try the script)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    spec = {**wl.workloads(args.smoke), **({} if args.smoke else wl.EXTRA)}[args.workload]
    pairs = [tuple(int(x) for x in s.split(",")) for s in (args.steps_pair or ["1,3", "3,10"])]
    wl.cap_memory(spec.device, spec.budget)
    model, batch, loss_fn = wl.build(spec)
    for text in args.config or list(W3_CONFIGS):
        rung, micro, share = parse_config(text)
        row = {"workload": spec.name, "rung": dataclasses.asdict(rung), "name": rung.name, "micro": micro,
               "offload_fraction": share, "trials": []}
        for warmup, measured in pairs:
            runner, _ = wl.trial_runner(spec, model, batch, loss_fn, spec.device, measured_steps=measured)
            runner.work.warmup_steps = warmup
            t = runner(rung, micro, offload_fraction=share)
            row["trials"].append({"warmup": warmup, "measured": measured, "outcome": t.outcome,
                                  "rate": t.samples_per_second * spec.per_sample, "step_s": t.step_seconds,
                                  "optimizer_s": t.optimizer_seconds, "peak_gib": t.peak_bytes / 2**30})
        train = wl.train_steps(spec, model, batch, loss_fn, spec.device, rung, micro, args.train,
                               offload_fraction=share)
        row["trained"] = train["samples_per_second"] * spec.per_sample
        row["train_oom"] = train["oom"]
        ratios = ", ".join(f"({t['warmup']},{t['measured']}) {t['rate']:,.0f} = {t['rate'] / row['trained']:.3f}x"
                           for t in row["trials"] if row["trained"])
        print(f"{rung.name:32} @{micro:4d}: trained {row['trained']:,.0f} {spec.unit}; estimates {ratios}", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({**row, **wl.environment(spec.device)}) + "\n")


if __name__ == "__main__":
    main()
