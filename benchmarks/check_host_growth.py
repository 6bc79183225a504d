"""Host memory across a tune's trials: does the process's resident set grow with each optimizer-offload trial?

Runs the same optimizer-offload trial (full share, then half, then full again, as the share search does)
several times through autotune's `TrialRunner` and prints the process RSS and the pinned host allocator's
bytes after each. With `--keep-pinned-cache` the cached pinned blocks are not given back between trials
(torch's default), for comparison.

    python benchmarks/check_host_growth.py --model gpt2-medium --trials 4
    python benchmarks/check_host_growth.py --model gpt2-medium --trials 4 --keep-pinned-cache
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-medium")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to check the script (no pinned memory there)")
    parser.add_argument("--keep-pinned-cache", action="store_true", help="torch's default: cached pinned blocks kept")
    args = parser.parse_args()
    import torch

    if args.keep_pinned_cache:
        torch._C._host_emptyCache = None  # what release_memory looks for: absent, the cache is kept
    sys.path.insert(0, _HERE)
    import workloads

    from autotune.configuration import Rung
    from autotune.devices import host
    from autotune.devices.placement import resolve_device
    from autotune.search.trial import TrialRunner, Workload
    from autotune.techniques import find_blocks
    from autotune.workload.losses import default_loss
    from autotune.workload.optimizers import OptimizerSpec

    model, batch = workloads.build_gpt(args.model, args.device, args.seq)
    work = Workload(model=model, batch=batch, loss_fn=default_loss, spec=OptimizerSpec.from_user(None, model),
                    placement=resolve_device(args.device), budget_bytes=2**40, limit_bytes=2**40, per_rank=args.micro,
                    blocks=find_blocks(model), measured_steps=2)
    runner = TrialRunner(work)
    rung = Rung(checkpointing="full", offload="optimizer")
    base = host.resident_bytes()
    rows = []
    for k in range(args.trials):
        share = 0.5 if k % 3 == 1 else 1.0
        trial = runner(rung, args.micro, offload_fraction=share)
        stats = torch.cuda.memory.host_memory_stats() if args.device == "cuda" else {}
        pinned = next((v for k, v in stats.items() if k.startswith("allocated_bytes") and k.endswith("current")), 0)
        rows.append({"trial": k, "share": share, "outcome": trial.outcome, "seconds": round(trial.seconds, 1),
                     "rss_gib": round(host.resident_bytes() / 2**30, 2),
                     "rss_growth_gib": round((host.resident_bytes() - base) / 2**30, 2),
                     "pinned_cached_gib": round(pinned / 2**30, 2)})
        print(json.dumps(rows[-1]), flush=True)
    kept = "kept" if args.keep_pinned_cache else "given back"
    print(f"\npinned cache {kept}: RSS growth after each trial (GiB): {[r['rss_growth_gib'] for r in rows]}")


if __name__ == "__main__":
    main()
