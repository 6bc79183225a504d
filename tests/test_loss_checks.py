"""What autotune puts in place of the user's loss is checked on the user's model and example first
(`workload/loss_checks.py`): the chunked head against the model's own loss, and the micro-batch weighting against
the whole batch's loss.

Each model is tuned by `fit` with micro-batches of at most 2 samples, then trained one step through
`plan.apply(model, optimizer)` and compared with one plain float64 SGD step on the whole batch: the update is
linear in the gradient, so a micro-batch weighted by the wrong share, or a loss other than the model's own,
shows. Hugging Face computes its losses in float32 (it upcasts the logits), so their values agree to float32's
rounding while the updates agree to 1e-9.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_models import tiny_llama
from test_step import make_plan
from torch import nn

import autotune
from autotune.workload.losses import chunked_default_loss

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow,  # importing transformers takes seconds
              pytest.mark.usefixtures("private_cache")]

TOL = 1e-9
FLOAT32 = 1e-6  # relative: a loss Hugging Face computes from float32 logits


@pytest.fixture(autouse=True)
def small_micro_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search tries micro-batches of at most 2 samples: every plan accumulates several."""
    monkeypatch.setenv("AUTOTUNE_MAX_MICRO_BATCH", "2")


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def tune(model: nn.Module, batch: Any, **kwargs: Any) -> autotune.Plan:
    kwargs.setdefault("techniques", ())
    return autotune.fit(model, batch, device="cpu", memory_budget="1GiB", cache=False, progress=False,
                        trial_steps=1, max_trials=2, **kwargs)


def plain_step(model: nn.Module, batch: Any, loss_fn: Any = None) -> tuple[nn.Module, float]:
    """One SGD step on the whole batch, as a user writes it; the trained copy and its loss."""
    m = copy.deepcopy(model)
    opt = sgd(m.parameters())
    out = loss_fn(m, batch) if loss_fn is not None else m(**batch)
    loss = out if isinstance(out, torch.Tensor) else out["loss"]
    loss.backward()
    opt.step()
    return m, float(loss.detach())


def planned_step(plan: autotune.Plan, model: nn.Module, batch: Any) -> float:
    """One step through `plan.apply(model, optimizer)`, the way a user trains after `fit`."""
    with plan.apply(model, sgd(model.parameters())) as step:
        return step(batch)


def assert_same_update(got: nn.Module, want: nn.Module, start: nn.Module) -> None:
    for (name, _), p, q in zip(start.named_parameters(), got.parameters(), want.parameters()):
        p, q = p.detach(), q.detach()
        assert float((p - q).abs().max()) <= TOL, f"{name}: {float((p - q).abs().max()):.2e} apart"
    moved = max(float((q - p0).detach().abs().max()) for p0, q in zip(start.parameters(), want.parameters()))
    assert moved > 1e-4  # the step moved the weights: the comparison can fail


def check_fit_against_plain(model: nn.Module, batch: Any, loss_fn: Any = None, rel: float = TOL,
                            **kwargs: Any) -> autotune.Plan:
    """`fit` then one step of its plan on `model` (which fit leaves as it found it) equals the plain step."""
    start = copy.deepcopy(model)
    want, want_loss = plain_step(model, batch, loss_fn)
    plan = tune(model, batch, loss_fn=loss_fn, **kwargs)
    assert plan.accumulation_steps >= 4
    loss = planned_step(plan, model, batch)
    assert loss == pytest.approx(want_loss, rel=rel)
    assert_same_update(model, want, start)
    return plan


# -- the chunked loss ----------------------------------------------------------------------------------------------

def masked_lm() -> nn.Module:
    """EuroBERT's masked LM: its head and loss_function look like a causal LM's, its loss is not next-token."""
    config = transformers.EuroBertConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=0,
                                         bos_token_id=1, eos_token_id=2, mask_token_id=3)
    torch.manual_seed(0)
    return transformers.EuroBertForMaskedLM(config).double()


def mlm_batch(n: int = 8, t: int = 10) -> dict[str, torch.Tensor]:
    """MLM labels: -100 everywhere but the masked tokens (a third of them, the first of each sequence too)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 64, (n, t), generator=g)
    masked = torch.rand(n, t, generator=g) < 0.3
    masked[:, 0] = True
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return {"input_ids": ids.masked_fill(masked, 3), "attention_mask": torch.ones_like(ids), "labels": labels}


def test_a_masked_lm_trains_on_its_own_loss_through_fits_plan():
    model, batch = masked_lm(), mlm_batch()
    plan = check_fit_against_plain(model, batch, rel=FLOAT32, techniques=("chunked_loss",))
    assert "ForMaskedLMLoss, not next-token prediction" in plan.reason


def soft_capped_llama() -> nn.Module:
    """A Llama whose head soft-caps its logits in a forward hook: its source hands lm_head's output straight to
    its loss, so only the value on the example shows the chunks would compute another loss."""
    model = tiny_llama()
    model.lm_head.register_forward_hook(lambda module, args, out: 3.0 * torch.tanh(out / 3.0))
    return model


def lm_batch(n: int = 7, t: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (n, t), generator=g)
    labels = ids.clone()
    for i, length in enumerate([3, 10, 5, 8, 2, 10, 6][:n]):
        labels[i, length:] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def test_the_chunked_loss_is_not_used_where_its_value_differs_from_the_models_own():
    model, batch = soft_capped_llama(), lm_batch()
    plan = check_fit_against_plain(model, batch, rel=FLOAT32, techniques=("chunked_loss",))
    assert "chunked_loss not used: on the example batch its loss differs from the model's own" in plan.reason
    with plan.apply(model, sgd(model.parameters())) as step:
        assert step.loss_fn is not chunked_default_loss
    plain = tiny_llama()  # without the hook the chunks give its loss, and are used
    plan = tune(plain, batch, techniques=("chunked_loss",))
    assert "chunked_loss not used" not in plan.reason
    with plan.apply(plain, sgd(plain.parameters())) as step:
        assert step.loss_fn is chunked_default_loss


# -- the weighting of micro-batches ---------------------------------------------------------------------------------

def ctc_model() -> nn.Module:
    config = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(4, 4), conv_kernel=(8, 8), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, ctc_loss_reduction="mean", pad_token_id=0, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
        mask_time_prob=0.0)
    torch.manual_seed(0)
    return transformers.Wav2Vec2ForCTC(config).double()


def test_ctc_with_a_mean_over_samples_fits_and_equals_a_full_batch_step():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(1, 12, (8, 6), generator=g)
    for i, length in enumerate([2, 6, 3, 5, 1, 4, 6, 2]):
        labels[i, length:] = -100  # transcripts of different lengths: a token share is not a sample share
    batch = {"input_values": torch.randn(8, 400, generator=g, dtype=torch.float64), "labels": labels}
    model = ctc_model()
    plan = tune(model, batch, techniques=None)  # the default techniques, the chunked loss among them
    assert "weighted by samples" in plan.reason
    plan = plan.with_config(micro_batch_size=2, accumulation_steps=4, last_micro_batch_size=2)  # 4, whatever it chose
    start = copy.deepcopy(model)
    want, want_loss = plain_step(model, batch)
    assert planned_step(plan, model, batch) == pytest.approx(want_loss, rel=FLOAT32)
    assert_same_update(model, want, start)


def segmenter() -> nn.Module:
    """A tiny Segformer, its head's BatchNorm left out: batch statistics tie a micro-batch's samples together,
    which no weighting undoes."""
    config = transformers.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], patch_sizes=[3, 3],
        strides=[2, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=16, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0, drop_path_rate=0.0)
    torch.manual_seed(0)
    model = transformers.SegformerForSemanticSegmentation(config)
    model.decode_head.batch_norm = nn.Identity()
    return model.double()


def test_segformer_pixels_labelled_255_count_for_nothing():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (7, 16, 16), generator=g)
    for i, rows in enumerate([12, 0, 6, 15, 3, 9, 1]):
        labels[i, :rows] = 255  # unlabelled pixels, a different share in every image
    batch = {"pixel_values": torch.randn(7, 3, 16, 16, generator=g, dtype=torch.float64), "labels": labels}
    plan = check_fit_against_plain(segmenter(), batch, rel=1e-12)
    assert "labels other than 255" not in plan.reason  # its own ignore index comes first: nothing to say


class PadZeroLM(nn.Module):
    """A model whose own loss is a mean over the tokens that are not its pad id 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(input_ids).cumsum(1)))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.logits(input_ids)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=0)}


class MeanOfSequenceMeans(PadZeroLM):
    """A model whose own loss is the mean over sequences of each sequence's token mean (-100 ignored)."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        nll = F.cross_entropy(self.logits(input_ids).transpose(1, 2), labels, ignore_index=-100, reduction="none")
        counted = (labels != -100).sum(1)
        return {"loss": (nll.sum(1) / counted).mean()}


class SummedTokens(PadZeroLM):
    """A model whose own loss is a sum over the batch's label tokens (-100 ignored), as CTC's "sum" is."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.logits(input_ids)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")}


def padded(pad: int, n: int = 7, t: int = 9) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 32, (n, t), generator=g)
    labels = ids.clone()
    for i, length in enumerate([2, 9, 4, 7, 3, 9, 5][:n]):
        labels[i, length:] = pad
    return {"input_ids": ids, "labels": labels}


def test_a_loss_that_ignores_pad_id_0_is_weighted_by_the_tokens_it_counts():
    plan = check_fit_against_plain(PadZeroLM().double(), padded(pad=0), rel=1e-12)
    assert "labels other than 0" in plan.reason


def test_a_mean_of_per_sequence_means_is_weighted_by_samples():
    plan = check_fit_against_plain(MeanOfSequenceMeans().double(), padded(pad=-100), rel=1e-12)
    assert "weighted by samples" in plan.reason


def test_a_loss_summed_over_the_batch_adds_its_micro_batches_whole(caplog):
    with caplog.at_level(logging.WARNING, logger="autotune"):
        plan = check_fit_against_plain(SummedTokens().double(), padded(pad=-100), rel=1e-12)
    assert "weighted as a sum" in plan.reason
    assert "no micro-batch weighting reproduces" not in caplog.text


def test_a_plan_applied_without_fit_checks_the_loss_on_the_first_batch():
    model, batch = MeanOfSequenceMeans().double(), padded(pad=-100)
    plan = make_plan(2, 7)  # a plan from a file or another process: no check ran on this model
    start = copy.deepcopy(model)
    want, want_loss = plain_step(model, batch)
    with plan.apply(model, sgd(model.parameters())) as step:
        assert step(batch) == pytest.approx(want_loss, rel=1e-12)
        assert "weighted by samples" in step.plan.reason
    assert_same_update(model, want, start)


def test_a_first_batch_check_on_a_micro_batch_takes_samples_whose_counts_differ():
    # The first two samples count 2 label tokens each: on them alone a token mean and a mean over samples give
    # the same loss. The check (two samples, as many as the micro-batch) must take one whose count differs.
    model, batch = MeanOfSequenceMeans().double(), padded(pad=-100)
    batch["labels"][1, 2:] = -100
    plan = make_plan(2, 7)
    start = copy.deepcopy(model)
    want, want_loss = plain_step(model, batch)
    with plan.apply(model, sgd(model.parameters())) as step:
        assert step(batch) == pytest.approx(want_loss, rel=1e-12)
        assert "weighted by samples" in step.plan.reason
    assert_same_update(model, want, start)


def smoothed(model: nn.Module, batch: Any) -> torch.Tensor:
    """Label smoothing as people write it: a scalar mean over the tokens that are not padding."""
    ids, targets = (batch["input_ids"], batch["labels"]) if isinstance(batch, dict) else batch
    logits = model.logits(ids)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, label_smoothing=0.1)


def test_a_scalar_token_mean_loss_fn_on_a_mapping_batchs_labels_is_weighted_by_tokens():
    plan = check_fit_against_plain(PadZeroLM().double(), padded(pad=-100), loss_fn=smoothed, rel=1e-12)
    assert "weighted by label tokens (labels other than -100)" in plan.reason


def test_a_scalar_token_mean_loss_fn_no_weighting_reproduces_is_said_once_with_the_fix(caplog):
    batch = padded(pad=-100)
    pairs = (batch["input_ids"], batch["labels"])  # no labels to count: only the samples to weigh by
    with caplog.at_level(logging.WARNING, logger="autotune"):
        plan = tune(PadZeroLM().double(), pairs, loss_fn=smoothed)
    said = [r.getMessage() for r in caplog.records if "no micro-batch weighting reproduces" in r.getMessage()]
    assert len(said) == 1 and "return (loss_sum, count) from a loss_fn" in said[0]
    assert "no micro-batch weighting reproduces loss_fn's loss on the example batch" in plan.reason
    assert "(loss_sum, count)" in plan.reason


def test_a_loss_fn_whose_counts_do_not_add_up_over_samples_is_flagged():
    def summed(model: nn.Module, batch: Any) -> tuple[torch.Tensor, float]:
        ids, targets = batch  # a sum over the batch's tokens, "over" one item whatever the batch holds
        return F.cross_entropy(model.logits(ids).flatten(0, 1), targets.flatten(), reduction="sum"), 1.0

    batch = padded(pad=5)
    plan = tune(PadZeroLM().double(), (batch["input_ids"], batch["labels"]), loss_fn=summed)
    assert "no micro-batch weighting reproduces loss_fn's loss on the example batch" in plan.reason


class _OutOfMemoryOnLongBatches(nn.Module):
    """Runs out of memory on a forward of more than `most` samples, as a GPU would on a larger batch."""

    def __init__(self, most: int) -> None:
        super().__init__()
        self.most = most
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.most:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return F.mse_loss(self.linear(x).squeeze(1), y)


def test_an_out_of_memory_check_raises_where_asked_and_leaves_the_loss_unchecked_otherwise():
    """Where the check visits a GPU (`check_device.py`) an OOM raises, so it runs again on the CPU; elsewhere the
    OOM is a failed forward like any other: the loss is left unchecked and the note says why."""
    from autotune.workload import loss_checks

    model = _OutOfMemoryOnLongBatches(most=2)
    batch = (torch.randn(4, 4), torch.randn(4))
    loss_fn = lambda m, b: m(*b)  # noqa: E731
    found = loss_checks.check(model, batch, loss_fn, chunked=False)
    assert any("not checked" in note and "OutOfMemoryError" in note for note in found.notes), found.notes
    with pytest.raises(torch.OutOfMemoryError), loss_checks.out_of_memory_raised():
        loss_checks.check(model, batch, loss_fn, chunked=False)
    found = loss_checks.check(model, batch, loss_fn, chunked=False)  # the context closed: noted again
    assert any("OutOfMemoryError" in note for note in found.notes)
    assert not loss_checks.check(_OutOfMemoryOnLongBatches(most=4), batch, loss_fn, chunked=False).notes
