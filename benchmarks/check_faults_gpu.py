"""Faults met after and inside `fit`, on a real GPU: what the CPU tests simulate.

    python benchmarks/check_faults_gpu.py            # on a GPU machine; prints one JSON line per check

1. `fit` without `memory_budget`, twice in a row, one process: the second is a cache hit (the
   budget is the free memory rounded to 1/64 of the GPU's).
2. A device-side assert inside a trial (an out-of-range index on the GPU): `fit` raises autotune's
   `DeviceError`, not the `torch.AcceleratorError` that clean-up would raise on the poisoned context.
   Run last: the context stays poisoned.

On the CPU it runs check 1 under the simulated ceiling and skips check 2.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, GPTConfig, random_batch

import autotune

CONFIG = GPTConfig(vocab_size=512, seq_len=128, n_layer=4, n_head=4, n_embd=256)


def report(check: str, **fields: object) -> None:
    print(json.dumps({"check": check, **fields}), flush=True)


def second_fit_hits(device: str, cache: str) -> None:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    batch = random_batch(CONFIG, 16, torch.Generator().manual_seed(0))
    sources, seconds = [], []
    for _ in range(2):
        started = time.perf_counter()
        plan = autotune.fit(model, batch, global_batch_size=16, device=device, cache=cache, max_trials=4)
        sources.append(plan.source)
        seconds.append(round(time.perf_counter() - started, 2))
    report("second fit without memory_budget hits", ok=sources == ["tuned", "cache"], sources=sources,
           seconds=seconds, budget_gib=round(plan.memory_budget_bytes / 2**30, 2))


class AssertsOnTheDevice(torch.nn.Module):
    """The GPT, whose forward indexes out of range on the GPU once trials run (a device-side assert)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(CONFIG)
        self.calls = 0

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 2:  # past the block profile and the FLOP count: inside a trial
            bad = torch.full_like(idx, CONFIG.vocab_size + 7)
            return self.gpt(bad, targets)  # nn.Embedding out of range: CUDA device-side assert
        return self.gpt(idx, targets)


def device_error_survives() -> None:
    model = AssertsOnTheDevice()
    batch = random_batch(CONFIG, 16, torch.Generator().manual_seed(0))
    try:
        autotune.fit(model, batch, global_batch_size=16, device="cuda", cache=False, max_trials=2)
    except Exception as exc:  # noqa: BLE001 - the type is what this check reports
        report("device-side assert in a trial", ok=isinstance(exc, autotune.DeviceError), raised=type(exc).__name__,
               message=str(exc)[:300], notes=getattr(exc, "__notes__", []))
        return
    report("device-side assert in a trial", ok=False, raised=None)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        second_fit_hits(device, os.path.join(tmp, "plans.db"))
    if device == "cuda":
        device_error_survives()
    else:
        report("device-side assert in a trial", ok=None, skipped="needs a CUDA GPU")


if __name__ == "__main__":
    main()
