"""Losses that are sums of parts of different kinds, weighted part by part (float64, CPU).

A `loss_fn` may return a mapping of named parts: a `(loss_sum, count)` part is weighted by its tokens' share
of the batch, a scalar part (a mean over samples) by its samples' share, so the accumulated gradient is the
full batch's whatever the split. A model's own loss holding a per-batch term is weighted whole by each
micro-batch's token share; where autotune cannot tell the term apart, it says so (test_models_moe.py has
the Hugging Face mixture-of-experts models).
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from test_step import TOL, Net, assert_same_training, make_plan, new_model, peak_of, run_plan, sgd
from torch import nn

import autotune
from autotune.errors import InvalidSetting
from autotune.workload.batching import split_sizes

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest.py

REG = 0.3  # weight of the per-sample regularizer


# -- a loss_fn of named parts: a token mean and a per-sample-mean regularizer -------------------------------

def labelled_batch(lengths: list[int], t: int = 12, seed: int = 3) -> dict[str, torch.Tensor]:
    """x (B, T, 3), y (B, T) and integer labels marking the first `lengths[i]` positions (-100 elsewhere), so
    the labels count the tokens the loss averages over before the first micro-batch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lengths), t, 3, generator=g, dtype=torch.float64)
    y = torch.randn(len(lengths), t, generator=g, dtype=torch.float64)
    labels = torch.where(torch.arange(t) < torch.tensor(lengths)[:, None], 1, -100)
    return {"x": x, "y": y, "labels": labels}


def parts_loss(model: Net, batch: dict) -> dict:
    """{"tokens": (squared error summed over the labelled positions, their count), "regularizer": the mean
    over samples of each sample's mean squared prediction over its labelled positions}. Trimmed to the
    micro-batch's longest labelled sequence, like dynamic padding, so micro-batches of long sequences need
    more memory."""
    mask = batch["labels"] != -100
    t = max(int(mask.sum(1).max()), 1)
    pred, mask = model.predict(batch["x"][:, :t]), mask[:, :t]
    err = (pred - batch["y"][:, :t]) ** 2 * mask
    per_sample = (pred ** 2 * mask).sum(1) / mask.sum(1).clamp(min=1)  # (B,)
    return {"tokens": (err.sum(), mask.sum()), "regularizer": REG * per_sample.mean()}


def full_batch_parts_step(model: Net, batch: dict, loss_fn=parts_loss) -> tuple[Net, float]:
    """One SGD step on the whole batch: every part computed on all of it at once."""
    m = copy.deepcopy(model)
    opt = sgd(m.parameters())
    loss = sum(v[0] / v[1] if isinstance(v, tuple) else v for v in loss_fn(m, batch).values())
    loss.backward()
    opt.step()
    return m, float(loss.detach())


LENGTHS = [0, 1, 9, 2, 12, 3, 5, 11]  # very different token counts per sample: token and sample shares differ


@pytest.mark.parametrize("micro", [3, 5, 8], ids=["uneven-3", "uneven-5", "whole"])
def test_a_token_mean_and_a_per_sample_regularizer_equal_a_full_batch_step(micro):
    model, batch = new_model(), labelled_batch(LENGTHS)
    got, step, losses = run_plan(make_plan(micro, 8), model, [batch], loss_fn=parts_loss)
    want, want_loss = full_batch_parts_step(model, batch)
    assert_same_training(model, got, want)
    assert math.isclose(losses[0], want_loss, rel_tol=TOL)
    assert "loss_fn" not in step.plan.reason  # nothing to say: the labels gave the total count up front


def test_named_parts_stay_exact_after_a_recovery():
    # The long sequences sit in the second micro-batch of 4: it runs out of memory under the simulated ceiling
    # after the first has accumulated gradients, and the batch is re-run at micro-batch 2.
    model = new_model()
    lengths = [2, 1, 3, 2, 64, 40, 64, 7]
    batch = labelled_batch(lengths, t=64)
    budget = (peak_of(make_plan(4, 8), model, batch, loss_fn=parts_loss)
              + peak_of(make_plan(2, 8), model, batch, loss_fn=parts_loss)) // 2
    got, step, losses = run_plan(make_plan(4, 8, budget=budget), model, [batch], loss_fn=parts_loss)
    want, want_loss = full_batch_parts_step(model, batch)
    assert [(r.micro_step, r.now) for r in step.recoveries] == [(1, "fp32 at micro-batch 2")]
    assert_same_training(model, got, want)
    assert math.isclose(losses[0], want_loss, rel_tol=TOL)


def test_means_only_are_each_weighted_by_their_samples():
    def two_means(m, b):
        x, y = b
        pred = m.predict(x)
        return {"fit": ((pred - y) ** 2).mean(), "regularizer": REG * (pred ** 2).mean()}

    model, batch = new_model(), (torch.randn(7, 5, 3, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64))
    got, _, losses = run_plan(make_plan(3, 7), model, [batch], loss_fn=two_means)
    want, want_loss = full_batch_parts_step(model, batch, two_means)
    assert_same_training(model, got, want)
    assert math.isclose(losses[0], want_loss, rel_tol=TOL)


def test_an_estimated_token_total_beside_means_is_said_once(caplog):
    # A tuple batch has no labels to count up front: the total is estimated from the first micro-batch and
    # the token part corrected at the end, which leaves the means off by estimate / total. Said, once.
    def tuple_parts(m, b):
        x, y, lengths = b
        mask = torch.arange(x.shape[1]) < lengths[:, None]
        pred = m.predict(x)
        return {"tokens": (((pred - y) ** 2 * mask).sum(), mask.sum()), "regularizer": REG * (pred ** 2).mean()}

    model = new_model()
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 12, 3, generator=g, dtype=torch.float64),
                torch.randn(8, 12, generator=g, dtype=torch.float64), torch.tensor(LENGTHS)) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="autotune"):
        _, step, _ = run_plan(make_plan(3, 8), model, batches, loss_fn=tuple_parts)
    said = [r.getMessage() for r in caplog.records if "not known before its first micro-batch" in r.getMessage()]
    assert len(said) == 1 and "'tokens'" in said[0], said
    assert "not known before its first micro-batch" in step.plan.reason


def test_parts_that_change_or_count_twice_are_refused():
    model, batch = new_model(), labelled_batch(LENGTHS)
    calls = {"n": 0}

    def changing(m, b):
        calls["n"] += 1
        parts = parts_loss(m, b)
        if calls["n"] > 1:
            del parts["regularizer"]
        return parts

    with pytest.raises(InvalidSetting, match="return the same parts"):
        run_plan(make_plan(4, 8), model, [batch], loss_fn=changing)
    with pytest.raises(InvalidSetting, match="at most one part may be a sum over a count"):
        run_plan(make_plan(4, 8), model, [batch],
                 loss_fn=lambda m, b: {**parts_loss(m, b), "again": parts_loss(m, b)["tokens"]})


def test_under_fsdp_a_count_beside_means_is_refused():
    # FSDP averages the gradients over ranks inside backward, before the global token count is known: the
    # means beside a (loss_sum, count) part could not get their share. The weights of a sharded step refuse.
    from autotune.workload.accumulation import LossWeights
    from autotune.workload.losses import loss_parts

    model, batch = new_model(), labelled_batch(LENGTHS[:4])
    weights = LossWeights(4, 1, divisor=4.0, estimate=1.0, sharded=True)
    with pytest.raises(InvalidSetting, match="under FSDP2 sharding"):
        weights.weigh_parts(loss_parts(parts_loss(model, batch)), 4)
    tokens_only = LossWeights(4, 1, divisor=4.0, estimate=1.0, sharded=True)
    assert tokens_only.weigh_parts(loss_parts({"tokens": parts_loss(model, batch)["tokens"]}), 4) is not None


def padded_lm_batch(n: int = 10, t: int = 10, seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids and labels padded (-100) at random lengths: micro-batches hold different numbers of tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (n, t), generator=g)
    labels = ids.clone()
    for i, length in enumerate(torch.randint(2, t + 1, (n,), generator=g).tolist()):
        labels[i, length:] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def micro_batches(batch: dict, micro: int) -> list[dict]:
    """The step's split: `split_sizes`, the smaller ones first (training.step runs an odd one out first)."""
    sizes, start, out = sorted(split_sizes(len(batch["input_ids"]), micro)), 0, []
    for size in sizes:
        out.append({k: v[start:start + size] for k, v in batch.items()})
        start += size
    return out


# -- a term autotune cannot tell apart from the rest of the loss ----------------------------------------------

class ZLossLM(nn.Module):
    """A token classifier whose forward divides its token sum by `num_items_in_batch` when given (as Hugging
    Face's loss kwargs do) and adds 0.1 x a z-loss over the micro-batch's logits, returned as `z_loss` with no
    coefficient autotune knows."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64)

    def forward(self, input_ids, labels, num_items_in_batch=None):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        flat = dict(input=logits.reshape(-1, 64), target=labels.reshape(-1), ignore_index=-100)
        ce = (nn.functional.cross_entropy(**flat, reduction="sum") / num_items_in_batch if num_items_in_batch
              else nn.functional.cross_entropy(**flat))
        z_loss = logits.logsumexp(-1).pow(2).mean()
        return {"loss": ce + 0.1 * z_loss, "z_loss": z_loss}


def z_batch(n: int = 8, seed: int = 1) -> dict[str, torch.Tensor]:
    batch = padded_lm_batch(n, 6, seed)
    return {"input_ids": batch["input_ids"], "labels": batch["labels"]}


def test_a_term_without_a_known_coefficient_is_weighted_with_the_loss_and_said_once(caplog):
    torch.manual_seed(0)
    model, batch = ZLossLM().double(), z_batch()
    with caplog.at_level(logging.WARNING, logger="autotune"):
        got, step, losses = run_plan(make_plan(3, 8), model, [batch, batch])
    # the whole loss weighted by each micro-batch's share of the label tokens, once per optimizer step
    m = copy.deepcopy(model)
    opt = sgd(m.parameters())
    parts = micro_batches(batch, 3)
    total = sum(float((b["labels"] != -100).sum()) for b in parts)
    for _ in range(2):
        want_loss = 0.0
        for b in parts:
            loss = m(**b)["loss"] * (float((b["labels"] != -100).sum()) / total)
            loss.backward()
            want_loss += float(loss.detach())
        opt.step()
        opt.zero_grad()
    assert_same_training(model, got, m)
    assert math.isclose(losses[1], want_loss, rel_tol=TOL)
    said = [r.getMessage() for r in caplog.records if "cannot tell apart" in r.getMessage()]
    assert len(said) == 1 and "z_loss" in said[0], said
    assert "z_loss" in step.plan.reason


def test_fit_says_in_the_plan_when_it_cannot_tell_a_term_apart():
    torch.manual_seed(0)
    model, batch = ZLossLM().double(), z_batch()
    plan = autotune.fit(model, batch, global_batch_size=8, optimizer=sgd(model.parameters()), memory_budget="64MiB",
                        device="cpu", cache=False, techniques=(), trial_steps=1, max_trials=2, progress=False)
    assert "z_loss" in plan.reason and "cannot tell apart" in plan.reason, plan.reason
