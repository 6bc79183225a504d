"""A mixture-of-experts model's router loss over micro-batches, against plain PyTorch on the model's own loss.

Mixtral's `.loss` (with `output_router_logits=True`) is its token mean plus `router_aux_loss_coef x aux_loss`, a
load-balancing loss over the routing of the tokens in that forward. The yardstick here is plain PyTorch
accumulation on the model's own, unmodified `.loss`: each micro-batch's loss times its share of the label tokens,
summed, one backward each, one SGD step (docs/moe-router-loss.md says why that convention, and why no
accumulation gives one routing of the whole batch).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_loss_parts import micro_batches, padded_lm_batch
from test_models_moe import tiny_mixtral
from test_step import assert_same_training, make_plan, peak_of, run_plan, sgd
from torch import nn

import autotune

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow,  # importing transformers takes seconds
              pytest.mark.usefixtures("private_cache")]

TOL = 1e-9
N = 10  # padded_lm_batch's samples


def tokens(batch: dict) -> float:
    """The label tokens a causal LM's loss averages over (its first label predicts nothing)."""
    return float((batch["labels"][:, 1:] != -100).sum())


def model_loss_accumulation(model: nn.Module, batch: dict, micro: int) -> tuple[nn.Module, float, float]:
    """Plain PyTorch on a copy of `model`: each micro-batch's own `model(**mb).loss`, times its share of the label
    tokens, backward; one SGD step. The model, the accumulated loss and the share-weighted router loss."""
    m = copy.deepcopy(model)
    opt = sgd(m.parameters())
    parts = micro_batches(batch, micro)
    total = sum(tokens(part) for part in parts)
    loss = aux = 0.0
    for part in parts:
        share = tokens(part) / total
        out = m(**part)
        (out.loss * share).backward()
        loss += share * float(out.loss.detach())
        aux += share * float(out.aux_loss.detach())
    opt.step()
    return m, loss, aux


@pytest.mark.parametrize("rung", [{}, {"checkpointing": "full", "offload": "optimizer"}], ids=["plain", "offload"])
def test_router_loss_accumulates_as_the_share_weighted_model_losses(rung):
    # 5 micro-batches of 2; the step trains on the model's own loss ("chunked_loss" not allowed)
    model, batch = tiny_mixtral(), padded_lm_batch()
    want, want_loss, _ = model_loss_accumulation(model, batch, 2)
    got, _, losses = run_plan(make_plan(2, N, **rung), model, [batch], techniques=("checkpointing", "offload"))
    assert math.isclose(losses[0], want_loss, rel_tol=TOL)
    assert_same_training(model, got, want)


def test_one_routing_of_the_whole_batch_is_not_the_mean_of_its_micro_batches():
    # The load-balancing loss multiplies per-expert fractions of the tokens one forward routes: on fewer tokens
    # the routing looks less balanced, so the micro-batches' mean lies above the whole batch's, and the step
    # follows the micro-batches' (the worked number in docs/moe-router-loss.md).
    model, batch = tiny_mixtral(), padded_lm_batch()
    with torch.no_grad():
        whole = model(**batch)
    _, want_loss, micro_aux = model_loss_accumulation(model, batch, 2)
    balanced = model.config.num_experts_per_tok  # the loss's value for a perfectly even routing
    assert micro_aux - balanced > 10 * (float(whole.aux_loss) - balanced) > 0
    _, _, losses = run_plan(make_plan(2, N), model, [batch], techniques=("checkpointing", "offload"))
    assert math.isclose(losses[0], want_loss, rel_tol=TOL)
    assert not math.isclose(losses[0], float(whole.loss), rel_tol=1e-4)


def test_fits_plan_accumulates_the_model_losses():
    # Without the chunked loss: its float64 cross-entropy is within float32's rounding of the model's own (which
    # rounds the logits to float32), what fit's check allows for such a loss, but not within 1e-9.
    model, batch = tiny_mixtral(), padded_lm_batch()
    budget = min(peak_of(make_plan(N, N, checkpointing="full", offload=offload), model, batch)
                 for offload in ("optimizer", "activations"))  # no rung takes the whole batch at once
    plan = autotune.fit(model, batch, global_batch_size=N, optimizer=sgd, device="cpu", memory_budget=budget,
                        cache=False, trial_steps=1, progress=False, techniques=("checkpointing", "offload"))
    assert plan.accumulation_steps >= 2, plan.reason
    assert "router loss" in plan.reason, plan.reason
    got = copy.deepcopy(model)
    loss = plan.apply(got, sgd(got.parameters()))(batch)
    want, want_loss, _ = model_loss_accumulation(model, batch, plan.micro_batch_size)
    assert math.isclose(loss, want_loss, rel_tol=TOL)
    assert_same_training(model, got, want)
