"""The model zoo: Hugging Face families as people train them, each through `fit`'s own plan, against plain PyTorch.

Each family (tiny config, random weights, float64, `zoo_models.py`) is tuned by `autotune.fit` on the CPU under a
simulated budget below what any rung needs for the whole batch, so its plan splits the batch into micro-batches;
then `plan.apply(model, optimizer)` and one `step(batch)` must give the loss and the SGD update (linear in the
gradient, so a mis-weighted micro-batch shows) of one plain float64 step on the whole batch, to 1e-9, or to 1e-6
where the model computes its own loss in float32 (`precision`).

Where no micro-batching can give the whole batch's loss (a MoE's router loss is a product of per-expert
fractions over the tokens it sees; BatchNorm normalizes over the samples it sees), the yardstick is plain
PyTorch accumulation over the plan's micro-batches, each loss weighted by its share, and `plan.reason` must say
that the whole batch's loss is not reproduced.

Families that fail for a known reason are strict xfails: when the fix lands the test passes, pytest reports it
as a failure, and the mark goes.
"""

from __future__ import annotations

import copy
import gc
import re
from collections.abc import Iterator

import pytest
import torch
from test_step import make_plan, peak_of, sgd
from torch import nn

import autotune
from autotune.plan import Plan
from autotune.workload.batching import split_sizes

transformers = pytest.importorskip("transformers")
from zoo_models import FAMILIES, Family, N  # noqa: E402

pytestmark = [pytest.mark.slow,  # importing transformers takes seconds
              pytest.mark.usefixtures("private_cache")]

TOL = 1e-9
FLOAT32_TOL = 1e-6  # a loss the model computes in float32 (`precision`)


@pytest.fixture(scope="module", autouse=True)
def garbage_collector_frozen() -> Iterator[None]:
    """Each trial ends with `gc.collect()`, whose cost grows with every object alive in the process: with
    transformers and its models imported that is ~0.15 s a trial, most of a tiny model's search. Every family is
    built once first (transformers imports a model's module when it is first used), then what is alive is left
    out of later collections; the trials' own garbage is collected as before."""
    for family in FAMILIES:
        family.build()
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def tokens(batch: dict) -> float:
    """The label tokens a causal LM's loss averages over (its first label predicts nothing)."""
    return float((batch["labels"][:, 1:] != -100).sum())


def samples(batch: dict) -> float:
    return float(len(batch["labels"]))


# Families whose whole-batch loss no micro-batching gives: the reference accumulates the plan's micro-batches,
# each weighted by its share (`SPLIT`), and the plan's reason must say it (`FLAGGED`, a regex).
SPLIT = {"mixtral_moe": tokens, "qwen2_moe": tokens, "resnet_image_cls": samples}
FLAGGED = {"mixtral_moe": r"(?i)router|aux_loss", "qwen2_moe": r"(?i)router|aux_loss",
           "resnet_image_cls": r"(?i)batch ?norm|batch statistics"}


def xfail(reason: str, raises: type[Exception] | None = None) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=reason, raises=raises)


CTC_CRASH = "the step crashes: RuntimeError: The size of tensor a (312) must match the size of tensor b (48)"
NUM_ITEMS_DROPPED = ("num_items_in_batch is passed to a forward that takes **kwargs and names self.loss_function "
                     "but calls it without them (losses.takes_num_items), so each micro-batch's mean is taken for a "
                     "sum over the batch: loss and gradients x the number of micro-batches")
ROUTER_UNSAID = "the plan's reason does not say that the router loss over micro-batches is not the whole batch's"
KNOWN = {
    "eurobert_mlm": xfail("the chunked loss takes over EuroBERT's lm_head and trains the masked LM on a causal "
                          "(shifted) loss: loss 4.9% low, updates up to 130% off"),
    "wav2vec2_ctc": xfail(CTC_CRASH, raises=RuntimeError),
    "hubert_ctc": xfail(f"{CTC_CRASH}; past the crash, the loss of ctc_loss_reduction 'mean' (a mean over samples) "
                        "comes out x the number of micro-batches"),
    "segformer_segmentation": xfail("pixels labelled 255 (Segformer's semantic_loss_ignore_index) are counted as "
                                    "valid when micro-batches are weighted: loss 1e-4 off, updates up to ~35% off"),
    "llava_vision_language": xfail("the first label token is counted although a causal loss never predicts it "
                                   "(55 tokens where the loss averages over 47): loss 14.5% low at any split"),
    "resnet_image_cls": xfail(f"{NUM_ITEMS_DROPPED}; and the reason does not say BatchNorm normalizes over each "
                              "micro-batch"),
    "gpt_neox_sequence_cls": xfail(NUM_ITEMS_DROPPED),
    "mixtral_moe": xfail(ROUTER_UNSAID, raises=AssertionError),
    "qwen2_moe": xfail(ROUTER_UNSAID, raises=AssertionError),
}


def forced_budget(model: nn.Module, batch: dict) -> int:
    """A budget under which no rung fits the whole batch (the lightest, every block recomputed with optimizer or
    activation offload, peaks above it even before `fit`'s margin), so the plan takes several micro-batches."""
    return min(peak_of(make_plan(N, N, checkpointing="full", offload=offload), model, batch)
               for offload in ("optimizer", "activations"))


def micro_batches(batch: dict, plan: Plan) -> list[dict]:
    """The plan's split of `batch`, in the step's order (a smaller odd one out first)."""
    sizes, start, out = sorted(split_sizes(N, plan.micro_batch_size, plan.min_micro_batch_size)), 0, []
    for size in sizes:
        out.append({k: v[start:start + size] for k, v in batch.items()})
        start += size
    return out


def plain_step(model: nn.Module, batch: dict, plan: Plan, share=None) -> tuple[nn.Module, float, float]:
    """One plain PyTorch SGD step on a copy of `model`: the whole batch's loss, or with `share` the plan's
    micro-batches, each loss weighted by its share. The model, the loss, and the tolerance the loss's dtype allows
    (`precision`)."""
    m = copy.deepcopy(model)
    opt = sgd(m.parameters())
    parts = micro_batches(batch, plan) if share else [batch]
    total = sum(share(b) for b in parts) if share else 1.0
    loss, tol = 0.0, TOL
    for part in parts:
        weight = share(part) / total if share else 1.0
        out = m(**part).loss
        (out * weight).backward()
        loss += weight * float(out.detach())
        tol = max(tol, precision(out))
    opt.step()
    return m, loss, tol


def precision(loss: torch.Tensor) -> float:
    """How close a step can come to a loss of this dtype. Hugging Face's causal and masked LM, token
    classification and CTC losses compute in float32 inside a float64 model (`logits.float()`, a float32
    log-softmax): their rounding (~1e-7) differs between a batch and its micro-batches, so no accumulation can
    match such a step closer than FLOAT32_TOL."""
    return TOL if loss.dtype == torch.float64 else FLOAT32_TOL


def assert_same_update(start: nn.Module, got: nn.Module, want: nn.Module, tol: float) -> None:
    """Updates within `tol` of the reference's, per tensor, relative to its update. A tensor whose gradient is zero
    but for rounding (attention key biases) has an update of rounding only: its floor is 1e-3 of the largest."""
    updates = [(name, p - p0, q - p0) for (name, p0), p, q in zip(start.named_parameters(), got.parameters(),
                                                                   want.parameters())]
    floor = 1e-3 * max(float(u.norm()) for _, _, u in updates)
    for name, got_update, want_update in updates:
        scale = max(float(want_update.norm()), floor)
        gap = float((got_update - want_update).norm())
        assert gap <= tol * scale, f"{name}: update {gap / scale:.1e} off"


@pytest.mark.parametrize("family", [pytest.param(f, id=f.name, marks=KNOWN.get(f.name, ())) for f in FAMILIES])
def test_fits_plan_trains_as_the_plain_float64_step(family: Family):
    model, batch = family.build()
    plan = autotune.fit(model, batch, global_batch_size=N, optimizer=sgd, device="cpu",
                        memory_budget=forced_budget(model, batch), cache=False, trial_steps=1, progress=False)
    assert plan.accumulation_steps >= 2, plan.reason

    trained = copy.deepcopy(model)
    loss = plan.apply(trained, sgd(trained.parameters()))(batch)
    want, want_loss, tol = plain_step(model, batch, plan, SPLIT.get(family.name))
    assert abs(loss - want_loss) <= tol * abs(want_loss), f"loss {loss} where plain PyTorch gives {want_loss}"
    assert_same_update(model, trained, want, tol)
    if family.name in FLAGGED:
        assert re.search(FLAGGED[family.name], plan.reason), plan.reason


def test_the_zoo_spans_the_families_people_train():
    tasks = {f.task for f in FAMILIES}
    assert len(FAMILIES) >= 20 and {"masked-lm", "causal-lm", "seq2seq", "ctc", "audio-cls", "image-cls",
                                    "segmentation", "vision-language", "moe", "sequence-cls"} <= tasks
