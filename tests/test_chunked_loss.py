"""The chunked head and loss (`workload/chunked_loss.py`): the model's own loss and gradients, in float64, with
the full logits never held; used by the default loss when allowed, and by `fit`'s search.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_models import float64_causal_loss, padded_lm_batch, tiny_gpt2, tiny_llama
from test_step import make_plan, sgd
from torch import nn

from autotune.training.step import TrainingStep
from autotune.workload.chunked_loss import chunked, linear_cross_entropy, why_not
from autotune.workload.losses import chunked_default_loss, default_loss, resolve

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow,  # importing transformers takes seconds
              pytest.mark.usefixtures("private_cache")]


@pytest.mark.parametrize("num_items", [None, 23.0])
@pytest.mark.parametrize("rows_per_chunk", [1, 7, 1000])
def test_linear_cross_entropy_equals_cross_entropy_of_the_full_logits(num_items, rows_per_chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 8, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(29, 8, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(29, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 29, (3, 11), generator=g)
    targets[0, 4:9] = -100
    logits = hidden @ weight.T + bias
    if num_items is None:
        want = F.cross_entropy(logits.reshape(-1, 29), targets.reshape(-1), ignore_index=-100)
    else:
        want = F.cross_entropy(logits.reshape(-1, 29), targets.reshape(-1), ignore_index=-100,
                               reduction="sum") / num_items
    want_grads = torch.autograd.grad(want * 3.0, (hidden, weight, bias))
    got = linear_cross_entropy(hidden, weight, bias, targets, num_items_in_batch=num_items,
                               chunk_bytes=rows_per_chunk * 4 * 29)
    got_grads = torch.autograd.grad(got * 3.0, (hidden, weight, bias))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_in_16_bits_the_padded_vocabulary_gives_the_unpadded_loss_and_gradients():
    """Under bf16 autocast the head's matmuls run on the vocabulary padded to `align` (29 words to 64): the
    padding's logits must stay out of the log-sum-exp and its rows out of the weight's gradient."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 8, generator=g, requires_grad=True)
    weight = torch.randn(29, 8, generator=g, requires_grad=True)
    bias = torch.randn(29, generator=g, requires_grad=True)
    targets = torch.randint(0, 29, (3, 11), generator=g)
    targets[0, 4:9] = -100
    results = []
    for align in (64, 1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = linear_cross_entropy(hidden, weight, bias, targets, chunk_bytes=7 * 4 * 29, align=align)
        results.append((loss, *torch.autograd.grad(loss, (hidden, weight, bias))))
    padded, unpadded = results
    assert padded[2].shape == weight.shape
    for a, b in zip(padded, unpadded):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_a_float64_head_computes_in_float64_under_bf16_autocast():
    """Autocast leaves float64 operators alone, so the model's own head runs in float64 there: so does the chunk."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 8, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(29, 8, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 29, (2, 7), generator=g)
    want = F.cross_entropy((hidden @ weight.T).reshape(-1, 29), targets.reshape(-1))
    want_grads = torch.autograd.grad(want, (hidden, weight))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(hidden, weight, None, targets)
    got_grads = torch.autograd.grad(got, (hidden, weight))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_without_grad_it_is_the_loss_alone():
    hidden, weight = torch.randn(2, 5, 4, dtype=torch.float64), torch.randn(9, 4, dtype=torch.float64)
    targets = torch.randint(0, 9, (2, 5))
    with torch.no_grad():
        got = linear_cross_entropy(hidden, weight, None, targets)
    torch.testing.assert_close(got, F.cross_entropy((hidden @ weight.T).reshape(-1, 9), targets.reshape(-1)))


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama])  # GPT-2 ties its head to the embedding; this Llama not
@pytest.mark.parametrize("num_items", [None, 31.0])
def test_a_hugging_face_model_gets_its_own_loss_and_gradients(make, num_items):
    model, batch = make(), padded_lm_batch()
    want = float64_causal_loss(model, batch, num_items)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    got = chunked_default_loss(model, batch, num_items_in_batch=num_items)
    got_grads = torch.autograd.grad(got, list(model.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_the_model_is_put_back_after_the_loss_and_after_an_error():
    model, batch = tiny_gpt2(), padded_lm_batch()
    chunked_default_loss(model, batch)
    assert "forward" not in vars(model.lm_head) and "_loss_function" not in vars(model)
    assert model(input_ids=batch["input_ids"]).logits.shape[-1] == 64  # full logits again
    with pytest.raises(RuntimeError, match="inside"):
        with chunked(model):
            raise RuntimeError("inside")
    assert "forward" not in vars(model.lm_head) and "_loss_function" not in vars(model)
    sentinel = lambda *a, **k: torch.zeros(())  # noqa: E731 - a user's own loss_function survives
    model.loss_function = sentinel
    chunked_default_loss(model, batch)
    assert model.loss_function is sentinel


def test_models_it_cannot_chunk_say_why():
    assert why_not(tiny_gpt2()) is None and why_not(tiny_llama()) is None
    assert "lm_head" in why_not(nn.Sequential(nn.Linear(2, 2)))
    gemma2 = getattr(transformers, "Gemma2ForCausalLM", None)
    if gemma2 is not None:  # soft-caps its logits between the head and the loss
        config = transformers.Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=2, head_dim=8)
        assert "changes the logits" in why_not(gemma2(config))
    assert resolve(None, nn.Linear(2, 2), chunked=True) is default_loss  # not a causal LM: the plain loss
    # Mamba's forward returns `self.lm_head(...).float()`: the model rounds its logits where the chunks would not
    config = transformers.MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                                      conv_kernel=2)
    assert ".float()" in why_not(transformers.MambaForCausalLM(config))


def lora_llama(targets: tuple[str, ...] = ("q_proj", "v_proj"), **lora: object) -> nn.Module:
    """A tiny float64 Llama inside peft's wrapper, LoRA on `targets`; random adapters, so they count."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=list(targets), init_lora_weights=False, **lora)
    return peft.get_peft_model(tiny_llama(), config).double()


@pytest.mark.parametrize("task_type", ["CAUSAL_LM", None])  # PeftModelForCausalLM, and the plain PeftModel
@pytest.mark.parametrize("num_items", [None, 31.0])
def test_a_peft_wrapped_model_gets_its_own_loss_and_gradients(task_type, num_items):
    model, batch = lora_llama(task_type=task_type), padded_lm_batch()
    assert why_not(model) is None and resolve(None, model, chunked=True) is chunked_default_loss
    trained = [p for p in model.parameters() if p.requires_grad]  # the adapters: peft freezes the base
    want = float64_causal_loss(model, batch, num_items)
    want_grads = torch.autograd.grad(want, trained)
    got = chunked_default_loss(model, batch, num_items_in_batch=num_items)
    got_grads = torch.autograd.grad(got, trained)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert model(input_ids=batch["input_ids"]).logits.shape[-1] == 64  # the head is put back


def test_a_step_on_a_peft_model_chunks_and_equals_a_full_batch_float64_step():
    batch = padded_lm_batch()
    model, reference = lora_llama(task_type="CAUSAL_LM"), lora_llama(task_type="CAUSAL_LM")
    optimizer = sgd([p for p in reference.parameters() if p.requires_grad])
    float64_causal_loss(reference, batch, None).backward()
    optimizer.step()
    with TrainingStep(make_plan(4, 12), model, sgd([p for p in model.parameters() if p.requires_grad])) as step:
        assert step.loss_fn is chunked_default_loss
        step(batch)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_peft_head_it_cannot_chunk_is_named():
    assert "lm_head is a peft.tuners.lora.layer.Linear" in why_not(lora_llama(("q_proj", "lm_head")))
    saved = lora_llama(modules_to_save=["lm_head"])
    assert "lm_head is a peft.utils.other.ModulesToSaveWrapper" in why_not(saved)


def test_the_step_uses_it_unless_techniques_leave_it_out():
    model = tiny_gpt2()
    plan = make_plan(4, 12)
    assert TrainingStep(plan, model, sgd(model.parameters())).loss_fn is chunked_default_loss
    without = TrainingStep(plan, model, sgd(model.parameters()), techniques=("bf16", "checkpointing")).loss_fn
    assert without is default_loss


def test_a_step_with_it_equals_a_full_batch_float64_step():
    """Micro-batches of 4 with padded labels, weighted by tokens, chunked: the update of one full-batch step on
    the float64 loss (the unchunked loss upcasts the logits to FP32 only, so it matches to ~1e-7)."""
    batch = padded_lm_batch()
    model, reference = tiny_gpt2(), tiny_gpt2()
    optimizer = sgd(reference.parameters())
    float64_causal_loss(reference, batch, None).backward()
    optimizer.step()
    with TrainingStep(make_plan(4, 12), model, sgd(model.parameters())) as step:
        assert step.loss_fn is chunked_default_loss
        step(batch)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_fit_fits_a_larger_micro_batch_with_it():
    """A head of 4,000 words on 16 dimensions: the logits are most of a sample's memory, so at one budget the
    chunked loss fits a larger micro-batch. The CPU search runs under a simulated memory ceiling that counts
    bytes, so the largest micro-batch each search saw fit does not depend on the machine's load; which size
    trains fastest (the plan's pick) does, and is not compared."""
    import autotune

    config = transformers.GPT2Config(vocab_size=4000, n_positions=64, n_layer=2, n_embd=16, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 4000, (4, 64))
    plans = {}
    for name, techniques in (("chunked", ("chunked_loss",)), ("full", ())):
        plans[name] = autotune.fit(model, {"input_ids": ids, "labels": ids}, global_batch_size=32,
                                   memory_budget="40MiB", device="cpu", techniques=techniques, cache=False,
                                   progress=False, trial_steps=1)
    largest = {name: max(t.micro_batch_size for t in plan.trials if t.fits) for name, plan in plans.items()}
    assert "chunked_loss" in plans["chunked"].reason
    assert largest["chunked"] > largest["full"], largest


def test_a_compiled_model_gets_the_same_loss_and_its_full_logits_after():
    """Whole-model torch.compile traces through the patched head and loss (Dynamo and AOT autograd on the CPU;
    Inductor's kernels are the GPU's business): the same loss and gradients, and outside the loss call the
    compiled model gives its full logits again."""
    model, batch = tiny_gpt2(), padded_lm_batch()
    want = float64_causal_loss(model, batch)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    model.compile(backend="aot_eager")
    got = chunked_default_loss(model, batch)
    got_grads = torch.autograd.grad(got, list(model.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert model(input_ids=batch["input_ids"]).logits.shape[-1] == 64
