"""`fit` on a real GPU under real allocator ceilings (`torch.cuda.set_per_process_memory_fraction`).

The ceilings are set relative to the model's own size P (its FP32 weights in bytes), so the tests hold
on any large card: AdamW with FP32 weights needs about 4P at rest (weights, grads, two moments) and 5P
during its step (foreach temporaries); without checkpointing a sequence of 1024 adds several P of
activations per sample.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch

import autotune

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab_size=512, seq_len=1024, n_layer=24, n_head=16, n_embd=1024)


@pytest.fixture()
def capped():
    """Yields a function that caps this process at `budget` bytes; the cap is lifted afterwards."""
    total = torch.cuda.get_device_properties(0).total_memory

    def cap(budget: int) -> None:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(budget / total)

    yield cap
    torch.cuda.set_per_process_memory_fraction(1.0)
    gc.collect()
    torch.cuda.empty_cache()


def _model_and_batch():
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(CFG)
    ids = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), device="cuda")
    return model, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_checkpointing_is_needed_and_found(capped):
    model, batch = _model_and_batch()
    p = _param_bytes(model)
    budget = int(7.0 * p)  # limit 6.3P: the AdamW step and full checkpointing fit, an uncheckpointed sample does not
    capped(budget)
    with pytest.raises(autotune.NoFeasiblePlan, match="no configuration fits"):
        autotune.fit(model, batch, global_batch_size=16, memory_budget=budget, cache=False, techniques=("bf16",))
    plan = autotune.fit(model, batch, global_batch_size=16, memory_budget=budget, cache=False,
                        techniques=("bf16", "checkpointing"))
    assert plan.checkpointing != "none" and plan.offload == "none", plan.summary()
    assert not any(t.fits and t.rung.checkpointing == "none" for t in plan.trials)
    best = autotune.fit(model, batch, global_batch_size=16, memory_budget=budget, cache=False)
    assert best.checkpointing != "none"  # with offload allowed too, it may win; checkpointing stays needed
    assert plan.peak_memory_bytes <= 0.9 * budget
    assert plan.micro_batch_size * (plan.accumulation_steps - 1) + plan.last_micro_batch_size == 16


def test_optimizer_offload_is_needed_and_found(capped):
    model, batch = _model_and_batch()
    p = _param_bytes(model)
    budget = int(2.6 * p)  # below FP32 weights + grads + AdamW state (4P); above bf16 weights + grads (P)
    capped(budget)
    plan = autotune.fit(model, batch, global_batch_size=8, memory_budget=budget, cache=False)
    assert plan.offload == "optimizer", plan.summary()
    assert plan.peak_memory_bytes <= 0.9 * budget
    # fit restored the model: FP32 weights back on the GPU
    assert all(q.dtype == torch.float32 and q.is_cuda for q in model.parameters())


def test_trained_steps_fit_under_the_ceiling(capped):
    model, batch = _model_and_batch()
    budget = int(6.6 * _param_bytes(model))
    capped(budget)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plan = autotune.fit(model, batch, global_batch_size=8, memory_budget=budget, cache=False, optimizer=optimizer)
    step = plan.apply(model, optimizer)
    torch.cuda.reset_peak_memory_stats()
    losses = []
    for _ in range(3):
        ids = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len + 1), device="cuda")
        losses.append(step((ids[:, :-1].contiguous(), ids[:, 1:].contiguous())))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert torch.cuda.max_memory_reserved() <= budget
    assert step.plan.micro_batch_size == plan.micro_batch_size  # no recovery was needed


def _gpt2_on_the_cpu():
    """A Hugging Face GPT-2 of 4 blocks built on the CPU, where `from_pretrained` loads, and its example."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4))
    ids = torch.randint(0, 50257, (4, 512), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


@pytest.mark.usefixtures("private_cache")
def test_a_model_waiting_on_the_cpu_is_checked_on_the_gpu_and_left_on_the_cpu_as_it_was():
    """`fit` with the cache on, the model on the CPU: the loss check's forwards (eval mode, before any trial) run
    on the GPU, and the model ends on the CPU with its own parameter objects and values."""
    model, batch = _gpt2_on_the_cpu()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    seen: list[tuple[bool, str]] = []
    model.register_forward_pre_hook(lambda m, _: seen.append((m.training, next(m.parameters()).device.type)))
    plan = autotune.fit(model, batch, global_batch_size=8, device="cuda", memory_budget="16GiB", max_trials=2)
    checks = [device for training, device in seen[:next(i for i, (t, _) in enumerate(seen) if t)]]
    assert checks and set(checks) == {"cuda"}, seen[:8]
    assert all(a is b and a.device.type == "cpu" for a, b in zip(model.parameters(), params, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(params, before, strict=True))
    assert plan.micro_batch_size >= 1


def test_a_check_out_of_memory_on_the_gpu_runs_again_on_the_cpu_with_the_same_choice(capped):
    """Capped so the model fits on the GPU and its check's logits do not: the check runs again on the CPU, and
    chooses what a check on the CPU alone chooses; the model stays on the CPU throughout."""
    from autotune.devices.placement import resolve_device
    from autotune.workload import check_device, loss_checks

    model, batch = _gpt2_on_the_cpu()
    alone = loss_checks.check(model, batch, None, chunked=True)
    devices: list[str] = []
    model.register_forward_pre_hook(lambda m, _: devices.append(next(m.parameters()).device.type))
    # The move fits beside what the process holds already (earlier tests' graphs, cuBLAS workspaces); 4 x 512 x
    # 50257 float32 logits do not.
    gc.collect()
    torch.cuda.empty_cache()
    capped(torch.cuda.memory_reserved() + int(1.3 * _param_bytes(model)))
    found = check_device.checked(model, resolve_device("cuda"), None, 1,
                                 lambda: loss_checks.check(model, batch, None, chunked=True))
    assert devices[0] == "cuda" and devices[-1] == "cpu", devices
    assert found.choice == alone.choice and found.notes == alone.notes
    assert all(p.device.type == "cpu" for p in model.parameters())
