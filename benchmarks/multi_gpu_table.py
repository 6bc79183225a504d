"""Print benchmarks/bench_multi_gpu.sh's JSON lines as a short table (the last thing a GPU call prints)."""

import json
import sys

for line in open(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/data/multi_gpu.jsonl"):
    r = json.loads(line)
    head = f"{r['case']:15} {r['model']:12} x{r['world_size']} {r['budget']:6}"
    if "error" in r:
        print(head, "ERROR", r["error"][:300])
        continue
    print(head, f"tune {r.get('tune_seconds', 0):.1f}s", r.get("plan"), "|", r.get("reason", "")[:200])
    if "tokens_per_second" in r:
        print(" " * 8, f"{r['tokens_per_second']:,.0f} tok/s, {r['steps']} steps, recoveries {r['recoveries']},",
              f"sharded {r.get('sharded_after_apply')}, ranks agree {r.get('ranks_agree')} "
              f"(differ in {r.get('ranks_differ_in')})")
    for x in r.get("rungs", []):
        peak = x.get("max_allocated", x.get("simulated_peak", 0)) / 2**30
        print(" " * 8, f"{x['rung']:40} {x['outcome']:6} peak {peak:6.2f} GiB",
              f"{x.get('tokens_per_second', 0):,.0f} tok/s",
              x.get("error", "")[:200])
    if "arithmetic_floor_bytes" in r:
        print(" " * 8, f"arithmetic floor {r['arithmetic_floor_bytes'] / 2**30:.2f} GiB + transient "
              f"{r['arithmetic_transient_bytes'] / 2**30:.2f} GiB")
