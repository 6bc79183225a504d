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

Segformer's decode head holds a BatchNorm2d too: its reference weights each micro-batch by its labelled pixels
(255 ignored), which is what its loss averages over.
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


def pixels(batch: dict) -> float:
    """The labelled pixels a segmentation loss averages over (255 is Segformer's ignored pixel)."""
    return float((batch["labels"] != 255).sum())


# Families whose whole-batch loss no micro-batching gives: the reference accumulates the plan's micro-batches,
# each weighted by its share (`SPLIT`), and the plan's reason must say it (`FLAGGED`, a regex). FLAGGED also
# holds what the reason says of a loss weighted other than as a token or sample mean.
SPLIT = {"mixtral_moe": tokens, "qwen2_moe": tokens, "resnet_image_cls": samples,
         "segformer_segmentation": pixels}  # its decode head holds a BatchNorm2d
FLAGGED = {"mixtral_moe": r"(?i)router|aux_loss", "qwen2_moe": r"(?i)router|aux_loss",
           "wav2vec2_ctc": r"weighted as a sum",  # ctc_loss_reduction "sum": said, and exact
           "resnet_image_cls": r"(?i)batch ?norm|batch statistics",
           "segformer_segmentation": r"(?i)batch ?norm|batch statistics"}


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


@pytest.mark.parametrize("family", [pytest.param(f, id=f.name) for f in FAMILIES])
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
