"""Hugging Face mixture-of-experts models with their router loss on (tiny configs, random init, float64, CPU).

Mixtral and Qwen2-MoE with `output_router_logits=True` add `router_aux_loss_coef x aux_loss` (a
load-balancing loss over the batch's routing) to their token mean. The step weights each micro-batch's whole
loss by its share of the label tokens, so the router loss accumulates as the share-weighted mean of the
micro-batches' values (as Megatron-Core and the Hugging Face Trainer accumulate it) and no longer grows with
the number of micro-batches. Router gradients depend on each micro-batch's routing, so the yardstick is a
plain PyTorch accumulation that weights each micro-batch's whole loss by its share, not the full-batch step.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_loss_parts import micro_batches, padded_lm_batch
from test_step import TOL, assert_same_training, make_plan, peak_of, run_plan, sgd
from torch import nn

from autotune.training.step import TrainingStep

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow,  # importing transformers takes seconds
              pytest.mark.usefixtures("private_cache")]

COEF = 0.5  # the router loss's weight in the model's loss: large, so a mis-weighted router loss shows


def tiny_mixtral(seed: int = 0) -> nn.Module:
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=COEF, experts_implementation="eager")
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(config).double()


def tiny_qwen2_moe(seed: int = 0) -> nn.Module:
    config = transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        output_router_logits=True, router_aux_loss_coef=COEF, experts_implementation="eager")
    torch.manual_seed(seed)
    return transformers.Qwen2MoeForCausalLM(config).double()


def whole_loss(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(token mean, router loss) of one forward: the mean in float64 from the full logits, as the step's
    chunked loss computes it (Hugging Face's own `.loss` upcasts the logits to FP32 only). One forward for
    both: the model's RMSNorm computes in FP32, so two forwards' gradients would sum in a different place."""
    out = model(**batch)
    logits = out.logits
    shifted = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                                           ignore_index=-100)
    return ce, out.aux_loss


def tokens_of(batch: dict) -> float:
    return float((batch["labels"][:, 1:] != -100).sum())


def share_weighted_step(model: nn.Module, batch: dict, micro: int) -> tuple[nn.Module, float, float, float]:
    """Plain PyTorch accumulation: each micro-batch's whole loss (token mean + COEF x router loss) times its
    share of the label tokens, one SGD step. The model, the accumulated loss, its token-weighted CE and its
    share-weighted router loss."""
    m = copy.deepcopy(model)
    opt = sgd(m.parameters())
    parts = micro_batches(batch, micro)
    total = sum(tokens_of(b) for b in parts)
    ce_sum = aux_sum = 0.0
    for b in parts:
        share = tokens_of(b) / total
        ce, aux = whole_loss(m, b)
        ((ce + COEF * aux) * share).backward()
        ce_sum += share * float(ce.detach())
        aux_sum += share * float(aux.detach())
    opt.step()
    return m, ce_sum + COEF * aux_sum, ce_sum, aux_sum


def train_once(model: nn.Module, batch: dict, micro: int, **plan_kwargs) -> tuple[nn.Module, TrainingStep, float]:
    m, step, losses = run_plan(make_plan(micro, len(batch["input_ids"]), **plan_kwargs), model, [batch])
    return m, step, losses[0]


@pytest.mark.parametrize("micro", [3, 4], ids=["uneven-3", "uneven-4"])
@pytest.mark.parametrize("make_model", [tiny_mixtral, tiny_qwen2_moe], ids=["mixtral", "qwen2-moe"])
def test_moe_router_loss_is_the_share_weighted_mean_of_the_micro_batches(make_model, micro):
    model, batch = make_model(), padded_lm_batch()
    got, step, loss = train_once(model, batch, micro)
    want, want_loss, ce, aux = share_weighted_step(model, batch, micro)
    assert aux > 0.1 * ce  # the router loss is on, and large enough to show
    assert math.isclose(loss, ce + COEF * aux, rel_tol=TOL) and math.isclose(want_loss, ce + COEF * aux, rel_tol=TOL)
    assert_same_training(model, got, want)
    assert "cannot tell" not in step.plan.reason


@pytest.mark.parametrize("make_model", [tiny_mixtral, tiny_qwen2_moe], ids=["mixtral", "qwen2-moe"])
def test_moe_loss_does_not_grow_with_the_number_of_micro_batches(make_model):
    model, batch = make_model(), padded_lm_batch()
    whole = train_once(model, batch, 10)[2]
    for micro in (5, 2):  # 2 and 5 micro-batches
        assert abs(train_once(model, batch, micro)[2] - whole) <= 0.03 * whole, micro


def test_moe_router_loss_keeps_its_weight_through_a_recovery():
    # micro-batch 5 runs out of memory under the simulated ceiling; the batch is re-run at micro-batch 2, and
    # the router loss is the share-weighted mean over that split's micro-batches.
    model, batch = tiny_mixtral(), padded_lm_batch()
    budget = (peak_of(make_plan(5, 10), model, batch) + peak_of(make_plan(2, 10), model, batch)) // 2
    got, step, loss = train_once(model, batch, 5, budget=budget)
    assert step.recoveries and step.plan.micro_batch_size < 5
    want, want_loss, _, _ = share_weighted_step(model, batch, step.plan.micro_batch_size)
    assert math.isclose(loss, want_loss, rel_tol=TOL)
    assert_same_training(model, got, want)


