"""Train a small GPT with `autotune.fit`, written to run under `autotune run` (cooperative mode).

    autotune run --global-batch-size 32 --budget 40MiB examples/train_cooperative.py --steps 20

`fit` names neither the global batch nor the budget: `autotune run` passes them (and the cache path,
margin and device) as AUTOTUNE_* environment variables. If the job dies of an out-of-memory error anyway,
`autotune run` records the failure and restarts the script, whose `fit` then returns a smaller plan;
AUTOTUNE_RESTART_COUNT tells the script which attempt it is, so it resumes from its own checkpoint.
Without a GPU everything runs on the CPU under a simulated memory ceiling.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt import GPT, GPTConfig
from train_zero_change import pattern_batch

import autotune


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps in all (a restart resumes)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "autotune-example-gpt.pt"),
                   help="where to save and resume training (default: %(default)s)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    device = os.environ.get("AUTOTUNE_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    restart = int(os.environ.get("AUTOTUNE_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.width, seq_len=args.seq)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first_step = _resume(args.checkpoint, model, optimizer) if restart else 0
    generator = torch.Generator().manual_seed(1 + first_step)

    # An example batch; fit takes the global batch, budget and cache from `autotune run`.
    example = tuple(t.to(device) for t in pattern_batch(cfg, 8, generator))
    plan = autotune.fit(model, example, optimizer=optimizer)
    print(f"attempt {restart + 1}: {plan.summary()}", flush=True)
    step = plan.apply(model, optimizer)

    per_rank = plan.per_rank_batch_size
    started = time.perf_counter()
    for i in range(first_step, args.steps):
        batch = tuple(t.to(device) for t in pattern_batch(cfg, per_rank, generator))
        loss = step(batch)
        if (i + 1) % 5 == 0 or i + 1 == args.steps:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": i + 1},
                       args.checkpoint)
            rate = (i + 1 - first_step) * per_rank / (time.perf_counter() - started)
            print(f"step {i + 1:4d}  loss {loss:.4f}  {rate:,.1f} samples/s (wall clock)", flush=True)
    print(f"done with {step.plan.summary()}", flush=True)
    return 0


def _resume(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the last checkpoint, if there is one; the optimizer step to continue from."""
    if not os.path.exists(path):
        return 0
    state = torch.load(path, map_location="cpu")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    print(f"resuming from step {state['step']} ({path})", flush=True)
    return int(state["step"])


if __name__ == "__main__":
    raise SystemExit(main())
