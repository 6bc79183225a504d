"""Where compile's speed goes on W1's model: GPT-2 large compiled whole (the roof's way) or per repeated block as
autotune compiles it, with its dynamic batch and sequence marks or static, with the model's own loss or the
chunked one. One configuration per process (compile caches stay apart); no memory cap, no autotune search.

Trains `--steps` global steps of 64 samples at sequence 1024 (`--micro` a micro-batch, accumulated), bf16
autocast and AdamW, the GPU synchronized around each step; prints one JSON line, RESULT {...}: the median step
after the first two, its tokens/s and the peak memory.

    python benchmarks/bench_compile_modes.py --compile roof                  # torch.compile(model), static
    python benchmarks/bench_compile_modes.py --compile blocks                # autotune's blocks, dynamic marks
    python benchmarks/bench_compile_modes.py --compile blocks --static       # autotune's blocks, no marks
    python benchmarks/bench_compile_modes.py --compile blocks --loss chunked # and autotune's chunked loss
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import build_gpt

from autotune.techniques import compile as compiling
from autotune.techniques import find_blocks
from autotune.workload.losses import chunked_default_loss

GLOBAL_BATCH, SEQ, VOCAB = 64, 1024, 50257


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--compile", choices=("roof", "blocks", "whole"), default="blocks",
                   help="roof: torch.compile(model); blocks or whole: autotune's compile.install")
    p.add_argument("--static", action="store_true", help="autotune's install without its dynamic marks")
    p.add_argument("--loss", choices=("model", "chunked"), default="model")
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    if args.static:
        compiling.mark_batch_dynamic = lambda *_, **__: None  # every call specialized to its shapes
    if args.compile == "whole":
        os.environ["AUTOTUNE_COMPILE_REGIONS"] = "whole"
    model, _ = build_gpt("gpt2-large", "cuda", SEQ)
    optimizer = torch.optim.AdamW(model.parameters())
    run = torch.compile(model) if args.compile == "roof" else model
    if args.compile != "roof":
        compiling.install(model, find_blocks(model), 0)
    per_step = GLOBAL_BATCH // args.micro
    times = []
    for _ in range(args.steps):
        ids = torch.randint(0, VOCAB, (per_step, args.micro, SEQ), device="cuda")
        began = time.perf_counter()
        for m in range(per_step):
            batch = {"input_ids": ids[m], "labels": ids[m]}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = chunked_default_loss(run, batch) if args.loss == "chunked" else run(**batch).loss
            (loss / per_step).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    steady = sorted(times[2:])[len(times[2:]) // 2]
    print("RESULT " + json.dumps({**vars(args), "step_s": round(steady, 4), "tok_s": round(GLOBAL_BATCH * SEQ / steady),
                                  "first_s": round(times[0], 1), "times": [round(t, 3) for t in times],
                                  "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                                  "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)}))


if __name__ == "__main__":
    main()
