"""Models in dtypes other than FP32: every rung keeps each parameter's dtype, through `fit`,
`plan.apply` and `step.close()`; a rung that cannot train a dtype is left out with a note, never run into a crash.

Before: a float64 model crashed `fit` once the search reached optimizer offload (its device weights were cast
to bf16 under float64 inputs), and a bf16 model came back float32 from `close()` under optimizer offload.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_step import Net, make_plan, seq_batch, sgd

import autotune
from autotune.configuration import Rung
from autotune.errors import InvalidSetting
from autotune.search.floors import resident_floor
from autotune.techniques import serve_dtypes

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest.py


def model_in(dtype: torch.dtype, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net(width=16, depth=4).to(dtype)


def dtypes(model: torch.nn.Module) -> list[torch.dtype]:
    return [p.dtype for p in model.parameters()]


RUNGS = {
    "plain": dict(precision="bf16"),
    "fp32": dict(precision="fp32"),
    "full-ckpt": dict(precision="bf16", checkpointing="full"),
    "activation-offload": dict(precision="bf16", checkpointing="full", offload="activations"),
    "optimizer-offload": dict(precision="bf16", offload="optimizer"),
    "optimizer-offload-ckpt": dict(precision="bf16", checkpointing="full", offload="optimizer"),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bf16"])
@pytest.mark.parametrize("rung", list(RUNGS), ids=list(RUNGS))
def test_every_rung_trains_in_the_models_dtype_and_close_gives_it_back(dtype, rung):
    model = model_in(dtype)
    before = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = make_plan(2, 4, **RUNGS[rung]).apply(model, optimizer)
    losses = [step(seq_batch(4, 6, seed=s, dtype=dtype)) for s in range(2)]
    assert all(math.isfinite(x) for x in losses)
    if dtype == torch.float64:  # the model's own dtype in training too: no 16-bit copy next to float64 inputs
        assert set(dtypes(model)) == {torch.float64}
    step.close()
    assert dtypes(model) == dtypes(before)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before.parameters())), "nothing trained"
    # The optimizer state handed back holds the model's dtype (what AdamW would have built itself).
    assert {s["exp_avg"].dtype for s in optimizer.state.values()} == {dtype}


@pytest.mark.slow  # importing transformers takes seconds
def test_a_float64_llama_through_fits_own_plan_equals_a_float64_full_batch_step():
    """The default techniques hold bf16, which does not count as asking for it on a float64 model: the plan
    keeps float64, and its chunked head computes in float64 too."""
    pytest.importorskip("transformers")
    from test_models import full_batch_step, padded_lm_batch, tiny_llama

    model, batch = tiny_llama(), padded_lm_batch()
    plan = autotune.fit(model, batch, memory_budget="64MiB", device="cpu", cache=False, progress=False,
                        trial_steps=1, max_trials=4)
    assert plan.precision == "fp32" and "float64 model: kept in float64" in plan.reason, plan.reason
    assert "chunked_loss: the LM head" in plan.reason, plan.reason
    want = full_batch_step(model, batch)
    got = copy.deepcopy(model)
    with plan.apply(got, sgd(got.parameters())) as step:
        step(batch)
    for a, b in zip(got.parameters(), want.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_float64_model_tunes_onto_optimizer_offload_in_float64_by_default():
    """Under optimizer offload float64 weights keep their dtype on the device, so a float64 model at a budget
    only that rung fits keeps it without bf16: fp32 precision, its optimizer state on the host."""
    model = model_in(torch.float64)
    batch = seq_batch(8, 4, seed=1)
    budget = int(0.98 * resident_floor(Rung(), model, state_tensors=2) / 0.9)  # the plain rung's floor is over
    plan = autotune.fit(model, batch, memory_budget=budget, device="cpu", cache=False, progress=False,
                        trial_steps=1)
    assert (plan.precision, plan.offload) == ("fp32", "optimizer"), plan.reason
    assert "float64 model: kept in float64" in plan.reason
    start = copy.deepcopy(model)
    with plan.apply(model, torch.optim.AdamW(model.parameters(), lr=1e-2)) as step:
        assert math.isfinite(step(batch)) and set(dtypes(model)) == {torch.float64}
    assert dtypes(model) == dtypes(start) and any(not torch.equal(p, q) for p, q in
                                                  zip(model.parameters(), start.parameters()))


def test_a_float64_model_tunes_onto_optimizer_offload_and_trains_in_float64():
    model = model_in(torch.float64)
    batch = seq_batch(8, 4, seed=1)
    # The plain rung's weights, gradients and AdamW state alone are over the limit: only offload is left.
    plain = resident_floor(Rung(), model, state_tensors=2)
    budget = int(0.98 * plain / 0.9)
    start = copy.deepcopy(model)
    plan = autotune.fit(model, batch, memory_budget=budget, device="cpu", cache=False,
                        techniques=("bf16", "offload"))
    assert (plan.precision, plan.offload) == ("bf16", "optimizer"), plan.reason  # bf16 named: asked for
    assert dtypes(model) == dtypes(start) and all(torch.equal(p, q) for p, q in
                                                  zip(model.parameters(), start.parameters()))
    step = plan.apply(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    loss = step(batch)
    assert math.isfinite(loss) and set(dtypes(model)) == {torch.float64}
    step.close()
    assert set(dtypes(model)) == {torch.float64}


def test_a_bf16_model_keeps_bf16_through_fit_apply_and_close():
    model = model_in(torch.bfloat16)
    batch = seq_batch(8, 4, seed=2, dtype=torch.bfloat16)
    plan = autotune.fit(model, batch, memory_budget="40MiB", device="cpu", cache=False)
    assert set(dtypes(model)) == {torch.bfloat16}
    for offload in ("none", "optimizer"):  # the tuned plan, and the same under optimizer offload
        chosen = plan.with_config(offload=offload, offload_fraction=None,
                                     checkpointing="none", checkpointed_blocks=0)
        step = chosen.apply(model, torch.optim.AdamW(model.parameters()))
        step(batch)
        step.close()
        assert set(dtypes(model)) == {torch.bfloat16}, offload


def test_fp16_loss_scaling_is_never_run_on_a_float16_model():
    model = model_in(torch.float16)
    # torch's GradScaler refuses float16 gradients: that rung is left out, with the reason, and offload stays.
    kept, notes = serve_dtypes([Rung(precision="fp16"), Rung(precision="fp16", offload="optimizer")], model)
    assert kept == [Rung(precision="fp16", offload="optimizer")]
    assert len(notes) == 1 and "float16" in notes[0] and "optimizer offload" in notes[0]
    with pytest.raises(InvalidSetting, match="cannot train this model: fp16 loss scaling"):
        make_plan(2, 4, precision="fp16").apply(model, torch.optim.AdamW(model.parameters()))
    # Under optimizer offload it trains, and the model stays float16.
    step = make_plan(2, 4, precision="fp16", offload="optimizer").apply(model, torch.optim.AdamW(model.parameters()))
    assert math.isfinite(step(seq_batch(4, 6, dtype=torch.float16)))
    step.close()
    assert set(dtypes(model)) == {torch.float16}
