"""Gradient clipping and the optimizer-step callbacks of `plan.apply` (one process; the ranks are in
test_distributed_step.py).

The yardstick is `torch.nn.utils.clip_grad_norm_` on one full-batch step followed by the optimizer step,
in float64 to 1e-10 where the weights are float64. Under optimizer offload the device weights and
gradients are 16-bit, so there the host update is checked against clipping the same 16-bit gradients in
float64, to FP32 precision (the host masters are FP32).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_step import (
    TOL,
    assert_same_training,
    make_plan,
    new_model,
    padded_batch,
    run_plan,
    seq_batch,
    sgd,
    token_loss,
)

from autotune.errors import InvalidSetting
from autotune.training.step import TrainingStep


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "plans.db"))


def clipped_reference(model, batches, max_norm, make_opt=sgd, loss_fn=None):
    """Full-batch steps, each clipped with torch's clip_grad_norm_; the model and the norms it returned."""
    m = copy.deepcopy(model)
    opt = make_opt(m.parameters())
    norms = []
    for b in batches:
        if loss_fn is None:
            loss = m(*b)
        else:
            total, count = loss_fn(m, b)
            loss = total / count
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
    return m, norms


@pytest.mark.parametrize("micro,n", [(3, 8), (8, 8), (1, 5)], ids=["uneven", "whole", "ones"])
@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clips", "within"])
def test_clipping_equals_clip_grad_norm_on_a_full_batch_step(micro, n, max_norm):
    model = new_model()
    batches = [seq_batch(n, 6, seed=s) for s in range(3)]  # several steps: SGD momentum carries the clipped update
    want, want_norms = clipped_reference(model, batches, max_norm)
    norms = []
    got, step, _ = run_plan(make_plan(micro, n), model, batches, max_grad_norm=max_norm,
                            before_optimizer_step=lambda s: norms.append(s.last_grad_norm))
    assert_same_training(model, got, want)
    assert norms == pytest.approx(want_norms, rel=TOL)
    assert step.last_grad_norm == norms[-1]
    if max_norm < 1:
        assert min(want_norms) > max_norm  # the test clips for real


def test_clipping_a_token_weighted_loss_uses_the_whole_batch_norm():
    model = new_model()
    batch = padded_batch([0, 0, 1, 9, 2, 12, 3, 5], t=12)
    want, want_norms = clipped_reference(model, [batch], 0.01, loss_fn=token_loss)
    got, step, _ = run_plan(make_plan(3, 8), model, [batch], loss_fn=token_loss, max_grad_norm=0.01)
    assert_same_training(model, got, want)
    assert math.isclose(step.last_grad_norm, want_norms[0], rel_tol=TOL)


def test_clipping_after_a_recovered_oom_still_clips_the_whole_batch():
    model = new_model()
    batch = seq_batch(8, 6, seed=5)
    calls = {"n": 0}

    def flaky(m, b):  # the second micro-batch of the first attempt runs out of memory
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return m(*b)

    seen = []
    want, want_norms = clipped_reference(model, [batch], 0.05)
    got, step, _ = run_plan(make_plan(4, 8), model, [batch], loss_fn=flaky, max_grad_norm=0.05,
                            before_optimizer_step=lambda s: seen.append(s.plan.micro_batch_size))
    assert [r.now for r in step.recoveries] == ["fp32 at micro-batch 2"]
    assert seen == [2]  # once per optimizer step: not for the attempt that ran out of memory
    assert_same_training(model, got, want)
    assert math.isclose(step.last_grad_norm, want_norms[0], rel_tol=TOL)


def test_fp16_clips_the_unscaled_gradient():
    model = new_model(dtype=torch.float32)
    batch = seq_batch(8, 6, dtype=torch.float32)
    _, want_norms = clipped_reference(model, [batch], 1e6)
    _, step, _ = run_plan(make_plan(4, 8, precision="fp16"), model, [batch], max_grad_norm=1e6)
    assert float(step._applied.scaler.get_scale()) > 1  # the loss was scaled: a scaled norm would be that much larger
    assert step.last_grad_norm == pytest.approx(want_norms[0], rel=2e-2)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_optimizer_offload_clips_the_host_gradients(precision):
    model = new_model(dtype=torch.float32)
    batch = seq_batch(8, 6, dtype=torch.float32)
    plain = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    m = copy.deepcopy(model)
    step = TrainingStep(make_plan(4, 8, precision=precision, offload="optimizer"), m, plain(m.parameters()),
                        max_grad_norm=0.05)
    final = {}  # each 16-bit gradient as backward leaves it (the last micro-batch's hook: the whole batch's), unscaled

    def keep(i, p):
        scaler = step.optimizer.scaler
        final[i] = p.grad.double() / (float(scaler.get_scale()) if scaler is not None else 1.0)

    for i, p in enumerate(m.parameters()):
        p.register_post_accumulate_grad_hook(lambda p, i=i: keep(i, p))
    step(batch)
    grads = [final[i].clone() for i in range(len(final))]
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    want_norm = float(torch.nn.utils.clip_grad_norm_(params, 0.05))
    assert want_norm > 0.05
    assert math.isclose(step.last_grad_norm, want_norm, rel_tol=1e-6)
    for master, p in zip(step.optimizer.shares.masters, params):  # the FP32 gradients the host optimizer stepped with
        assert (master.grad.double() - p.grad).norm() <= 1e-6 * p.grad.norm()


def test_callbacks_run_around_the_optimizer_step():
    model = new_model()
    batch = seq_batch(6, 4, seed=2)
    events = []

    def before(step):
        events.append(("before", all(p.grad is not None for p in step.model.parameters()),
                       [p.detach().clone() for p in step.model.parameters()]))

    def after(step):
        events.append(("after", all(p.grad is not None for p in step.model.parameters()),
                       [p.detach().clone() for p in step.model.parameters()]))

    m = copy.deepcopy(model)
    step = make_plan(3, 6).apply(m, sgd(m.parameters()), before_optimizer_step=before, after_optimizer_step=after)
    step(batch)
    step(batch)
    assert [e[0] for e in events] == ["before", "after", "before", "after"]
    assert all(e[1] for e in events)  # the gradients are there in both
    assert all(torch.equal(a, b) for a, b in zip(events[0][2], model.parameters()))  # not yet stepped
    assert not all(torch.equal(a, b) for a, b in zip(events[1][2], events[0][2]))  # stepped
    assert step.last_grad_norm is None  # no max_grad_norm: nothing measured


@pytest.mark.parametrize("bad", [0, -1.0, "1.0", True])
def test_a_bad_max_grad_norm_is_refused(bad):
    model = new_model()
    with pytest.raises(InvalidSetting, match="max_grad_norm"):
        make_plan(2, 4).apply(model, sgd(model.parameters()), max_grad_norm=bad)


def test_a_hook_that_is_not_callable_is_refused():
    model = new_model()
    with pytest.raises(InvalidSetting, match="before_optimizer_step"):
        make_plan(2, 4).apply(model, sgd(model.parameters()), before_optimizer_step=3)
