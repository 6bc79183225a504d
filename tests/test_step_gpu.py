"""`plan.apply()` on a real GPU under a real ceiling: a GPT-2-style model trained while the sequence length
grows past what the plan was tuned for, and finishing.

The ceiling is `torch.cuda.set_per_process_memory_fraction(budget / total)`, so the caching allocator raises a
real `torch.OutOfMemoryError` past the budget, exactly as on a smaller card. Skipped without CUDA.

    python -m pytest tests/test_step_gpu.py -m gpu -q
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

import autotune

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from gpt import GPT, GPTConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BUDGET = 3 * 2**30  # bytes: small enough that seq 1024 cannot run at the micro-batch tuned at seq 256
TUNED_SEQ = 256
SCHEDULE = [256, 256, 512, 1024, 1024, 2048, 2048, 256, 256]  # sequence length of each optimizer step
GLOBAL_BATCH = 16
VOCAB = 512
EXPANDABLE_PAGE = 20 * 2**20  # bytes: the largest page torch's expandable segments map at a time

MakeBatch = Callable[[int, int, torch.Generator], Any]


def examples_gpt(max_seq: int, layers: int = 6, width: int = 384, heads: int = 6) -> tuple[torch.nn.Module, MakeBatch]:
    """examples/gpt.py: explicit attention, so memory grows with T^2 per layer."""
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=max_seq, n_layer=layers, n_head=heads, n_embd=width))

    def make(n: int, seq: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (n, seq + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    return model, make


def hf_gpt2(max_seq: int, layers: int = 6, width: int = 384, heads: int = 6) -> tuple[torch.nn.Module, MakeBatch]:
    """Hugging Face GPT-2 (random weights, nothing downloaded); `model(**batch).loss`."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=max_seq, n_layer=layers, n_embd=width,
                                     n_head=heads, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config)

    def make(n: int, seq: int, g: torch.Generator) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (n, seq), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}

    return model, make


def train_growing(build: Callable[..., tuple[torch.nn.Module, MakeBatch]], device: str, budget: int,
                  tuned_seq: int, schedule: list[int], global_batch: int, **model_args: Any):
    """Tune at `tuned_seq`, then train one optimizer step per entry of `schedule`; (plan, step, losses)."""
    torch.manual_seed(0)
    model, make = build(max(schedule), **model_args)
    model.to(device)
    g = torch.Generator().manual_seed(0)
    plan = autotune.fit(model, make(8, tuned_seq, g), global_batch_size=global_batch, memory_budget=budget,
                        device=device, cache=False)
    step = plan.apply(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    losses = [step(make(global_batch, seq, g)) for seq in schedule]
    step.close()
    return plan, step, losses


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """A recovery writes to the default plan cache: keep it inside the test's directory."""
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "plans.db"))


@pytest.fixture
def real_ceiling():
    """The process may allocate at most BUDGET bytes on GPU 0; restored afterwards."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(BUDGET / total, 0)
    torch.cuda.reset_peak_memory_stats(0)
    try:
        yield BUDGET
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()


@pytest.mark.parametrize("build", [examples_gpt, hf_gpt2], ids=["examples-gpt", "hf-gpt2"])
def test_training_outlives_sequences_longer_than_tuned(build, real_ceiling):
    plan, step, losses = train_growing(build, "cuda", real_ceiling, TUNED_SEQ, SCHEDULE, GLOBAL_BATCH)
    assert all(math.isfinite(v) for v in losses), losses
    assert step.recoveries, f"nothing ran out of memory with {plan.summary()}: raise the schedule's lengths"
    first = step.recoveries[0]
    assert SCHEDULE[first.step] > TUNED_SEQ  # the OOM came from the longer inputs
    assert (step.plan.micro_batch_size, step.plan.rung) != (plan.micro_batch_size, plan.rung)
    assert step.steps_taken == len(SCHEDULE)  # no step lost
    assert torch.cuda.max_memory_allocated(0) <= real_ceiling
    # Under expandable segments (autotune's default) torch maps reserved memory in pages of up to 20 MiB, and
    # its per-process cap can be passed by part of one (a second run in one process: 8 MiB, H200, torch 2.11).
    assert torch.cuda.max_memory_reserved(0) <= real_ceiling + EXPANDABLE_PAGE
