"""step.close() under optimizer offload: when the optimizer state cannot come back to the device, and what it
leaves holding the model (nothing).

On an H200 capped at 16 GiB, GPT-2 XL's AdamW moments (12 GB) were why the plan offloaded them, and
`close()` then died loading them back (benchmarks/RESULTS.md). The OOM is injected here at the
same call, the only place the CPU can meet it."""

from __future__ import annotations

import logging

import pytest
import torch
from test_step import make_plan, new_model, run_plan, seq_batch


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def test_close_keeps_the_state_on_the_host_when_it_does_not_fit_back(caplog):
    model = new_model(dtype=torch.float32)
    plan = make_plan(4, 8, precision="bf16", offload="optimizer")
    made: list[torch.optim.Optimizer] = []
    got, step, _ = run_plan(plan, model, [seq_batch(8, 5, seed=1, dtype=torch.float32)] * 2,
                            make_opt=lambda params: made.append(_adamw(params)) or made[-1])
    user = made[0]

    calls = {"n": 0}
    real = user.load_state_dict

    def out_of_memory_once(state):
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 30.00 MiB.")
        return real(state)

    user.load_state_dict = out_of_memory_once
    with caplog.at_level(logging.WARNING, logger="autotune"):
        step.close()
    assert calls["n"] == 1
    assert "stays on the host" in caplog.text
    states = [user.state[p] for p in got.parameters() if p in user.state]
    assert len(states) == len(list(got.parameters())), "every parameter's state is handed back"
    assert all(int(s["step"]) == 2 for s in states)
    assert all(s["exp_avg"].device.type == "cpu" and s["exp_avg"].abs().sum() > 0 for s in states)


@pytest.mark.slow  # seconds: searches that run real trial steps
def test_after_close_an_offloaded_model_is_freed_once_the_user_drops_it():
    """`fit`, `apply`, steps and `close()` under optimizer offload leave nothing holding the model: on a GPU,
    anything that did would keep its weights' memory from the user's next model."""
    import gc
    import os
    import sys
    import weakref

    import autotune

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, seq_len=32, n_layer=4, n_head=2, n_embd=64))
    ids = torch.randint(0, 97, (8, 33), generator=torch.Generator().manual_seed(0))
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    plan = autotune.fit(model, batch, global_batch_size=8, memory_budget=3 << 20, cache=False,
                        techniques=("bf16", "offload"))  # (checkpointing left out: a shorter search)
    assert plan.offload == "optimizer", plan.summary()  # 3 MiB holds no plan without it
    step = plan.apply(model, _adamw(model.parameters()))
    step(batch)
    step(batch)
    step.close()
    weights, whole = weakref.ref(next(model.parameters())), weakref.ref(model)
    del model, step
    gc.collect()
    assert whole() is None and weights() is None
