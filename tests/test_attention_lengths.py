"""Attention padded to a multiple of 64 tokens: the same outputs and gradients at every real position, cuDNN
shown a few lengths only, and nothing padded where padding would change what a real query sees."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autotune.configuration import Rung
from autotune.devices.placement import resolve_device
from autotune.techniques import apply_rung, attention_op, attention_padding
from autotune.techniques import attention_lengths as lengths
from autotune.workload.optimizers import OptimizerSpec

TORCH_SDPA = F.scaled_dot_product_attention  # torch's own, as this module found it

@pytest.fixture(autouse=True)
def _fresh_length_count():
    """Each test starts with no batch lengths seen, whatever ran before it in this process."""
    lengths.forget_lengths()
    yield
    lengths.forget_lengths()



def _record(monkeypatch) -> list[tuple[int, ...]]:
    """The query shapes that will reach torch's own attention (the kernel that builds a plan per shape)."""
    shapes: list[tuple[int, ...]] = []
    original = attention_padding.original

    def recorded(query, *args, **kwargs):
        shapes.append(tuple(query.shape))
        return original(query, *args, **kwargs)

    monkeypatch.setattr(attention_padding, "original", recorded)
    return shapes


def _count_masks(monkeypatch) -> list[int]:
    """How many padded masks get built (one counter in a list)."""
    built = [0]
    build = attention_padding._padded_mask

    def counted(*args, **kwargs):
        built[0] += 1
        return build(*args, **kwargs)

    monkeypatch.setattr(attention_padding, "_padded_mask", counted)
    return built


def _against_eager(model, eager, length: int, longest: int | None = None) -> tuple[set[int], list[int]]:
    """Three samples of `length` tokens (real lengths `length`, `length - 3` and 2) through `model` with attention
    padding in force, padded no further than `longest`, and through `eager` without it: the losses and gradients
    agree (float64). Returns the query lengths that reached torch's attention and the padded masks built."""
    ids = torch.randint(0, 97, (3, length), generator=torch.Generator().manual_seed(length))
    mask = (torch.arange(length)[None, :] < torch.tensor([length, length - 3, 2])[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    restore = lengths.install("cpu", longest)
    try:
        with pytest.MonkeyPatch.context() as spy:
            seen, built = _record(spy), _count_masks(spy)
            got = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            got.backward()
    finally:
        restore()
    want = eager(input_ids=ids, attention_mask=mask, labels=labels).loss
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    for (name, a), b in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-8, atol=1e-12, msg=name)
    return {shape[-2] for shape in seen}, built


def _tiny_gpt2(transformers, positions: int) -> torch.nn.Module:
    """A two-layer GPT-2 without dropout, the same weights on every call."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=positions,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture
def seen(monkeypatch) -> list[tuple[int, ...]]:
    return _record(monkeypatch)


def _inputs(length: int, heads: int = 4, kv_heads: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(length)
    return [torch.randn(2, h, length, 8, generator=g, dtype=torch.float64, requires_grad=True)
            for h in (heads, kv_heads, kv_heads)]


def _padding_mask(length: int, dtype: torch.dtype) -> torch.Tensor:
    """A batch's padding as a model passes it: sample 1 is 5 tokens shorter; causal within the real tokens."""
    real = torch.arange(length)[None, :] < torch.tensor([length, length - 5])[:, None]
    mask = torch.ones(length, length).tril().bool()[None, None] & real[:, None, None, :]
    mask |= torch.eye(length, dtype=torch.bool)  # every row sees a key, as models keep their padded rows finite
    if dtype == torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


CASES = {
    "causal": lambda n: {"is_causal": True},
    "bool-mask": lambda n: {"attn_mask": _padding_mask(n, torch.bool)},
    "float-mask": lambda n: {"attn_mask": _padding_mask(n, torch.float64)},
    "key-mask-one-row": lambda n: {"attn_mask": _padding_mask(n, torch.bool)[:, :, -1:, :]},
    "grouped-query": lambda n: {"is_causal": True, "enable_gqa": True},
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("length", [13, 64, 70])
def test_every_real_position_gets_the_attention_and_gradients_of_its_own_length(case, length, seen):
    heads = (4, 2) if case == "grouped-query" else (4, 4)
    kwargs = CASES[case](length)
    want_in, got_in = _inputs(length, *heads), _inputs(length, *heads)
    want = TORCH_SDPA(*want_in, **kwargs)
    seen.clear()
    got = attention_padding.padded_call(*got_in, kwargs.pop("attn_mask", None), **kwargs)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    for a, b in zip(got_in, want_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
    assert [s[-2] for s in seen] == [-(-length // 64) * 64], "the kernel saw another length than the bucket's"


@pytest.mark.parametrize("case", ["bool-mask", "float-mask", "key-mask-one-row"])
def test_masked_self_attention_is_padded(case, seen):
    q, k, v = _inputs(13)
    got = lengths.padded_attention(q, k, v, **CASES[case](13))
    torch.testing.assert_close(got, TORCH_SDPA(q, k, v, **CASES[case](13)), rtol=0, atol=1e-12)
    assert [s[-2] for s in seen] == [64]


def test_a_mask_is_padded_once_until_it_changes(monkeypatch):
    """The same mask, or another tensor over its memory, is padded once; a mask written in place, or another
    mask, is padded again."""
    built = _count_masks(monkeypatch)
    q, k, v = _inputs(13)
    mask = _padding_mask(13, torch.bool)
    for given in (mask, mask, mask.view(mask.shape), mask[:, :, :, :]):
        lengths.padded_attention(q, k, v, attn_mask=given)
    assert built == [1]
    mask[1, 0, 3, 2] = True  # written in place: its version moved
    got = lengths.padded_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, TORCH_SDPA(q, k, v, attn_mask=mask), rtol=0, atol=1e-12)
    lengths.padded_attention(q, k, v, attn_mask=mask.clone())
    assert built == [3]
    attention_padding.forget_masks()  # what a rung's removal does: the next call pads again
    lengths.padded_attention(q, k, v, attn_mask=mask)
    assert built == [4]


@pytest.mark.parametrize("case", ["no mask, not causal", "causal without a mask", "cross-attention",
                                  "mask broadcast over keys", "at a multiple of 64"])
def test_a_call_that_padding_would_change_or_not_help_runs_as_given(case, seen):
    """Unmasked calls come from batches of one fixed length (and, not causal, padding would be seen); a mask
    that is not over every key cannot hide the padded ones."""
    q, k, v = _inputs(64 if case == "at a multiple of 64" else 13)
    kwargs: dict = {}
    if case == "causal without a mask":
        kwargs["is_causal"] = True
    elif case == "cross-attention":
        k, v = (t[:, :, :9].detach() for t in (k, v))
        kwargs["attn_mask"] = torch.ones(2, 1, 13, 9, dtype=torch.bool)
    elif case == "mask broadcast over keys":
        kwargs["attn_mask"] = torch.ones(2, 1, 13, 1, dtype=torch.bool)
    elif case == "at a multiple of 64":
        kwargs["attn_mask"] = _padding_mask(64, torch.bool)
    got = lengths.padded_attention(q, k, v, **kwargs)
    torch.testing.assert_close(got, TORCH_SDPA(q, k, v, **kwargs), rtol=0, atol=0)
    assert [s[-2] for s in seen] == [q.shape[-2]]


def test_a_rung_routes_attention_through_the_buckets_where_wanted_and_its_removal_restores_it(monkeypatch):
    placement = resolve_device("cpu")
    model = torch.nn.Linear(4, 4)
    spec = OptimizerSpec.from_user(torch.optim.SGD(model.parameters(), lr=0.1), model)
    monkeypatch.delenv("AUTOTUNE_ATTENTION_BUCKETS", raising=False)
    assert not lengths.wanted("cpu") and lengths.note("cpu") == []  # on the CPU only where asked
    for setting, routed in (("1", True), ("0", False)):
        monkeypatch.setenv("AUTOTUNE_ATTENTION_BUCKETS", setting)
        applied = apply_rung(model, Rung(), spec, placement, None)
        assert (F.scaled_dot_product_attention is lengths.padded_attention) is routed
        if routed:
            lengths.padded_attention(*_inputs(13), attn_mask=_padding_mask(13, torch.bool))
            assert attention_padding._MASKS._padded is not None
        applied.remove()
        assert F.scaled_dot_product_attention is TORCH_SDPA
        assert attention_padding._MASKS._padded is None, "the rung's removal kept a padded mask alive"
    monkeypatch.setenv("AUTOTUNE_ATTENTION_BUCKETS", "1")
    assert "AUTOTUNE_ATTENTION_BUCKETS=0" in lengths.note("cpu")[0]  # the reason names the way out


@pytest.mark.slow  # seconds: Inductor compiles
@pytest.mark.parametrize("recomputed", [0, 2])
def test_compiled_attention_is_padded_too_and_one_graph_serves_every_length(monkeypatch, recomputed):
    """Compiled per block, a GPT-2 with padding masks runs one graph for lengths 9-32, its attention reaches
    torch's kernel at 64 tokens only (the padded call is one operator of the graph), and each loss and gradient
    is the unpadded eager one; with its blocks recomputed too (compiled inside their checkpoints)."""
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    from autotune.techniques import checkpointing, find_blocks
    from autotune.techniques import compile as compiling

    torch._dynamo.reset()
    model, eager = _tiny_gpt2(transformers, 32).double(), _tiny_gpt2(transformers, 32).double()
    monkeypatch.setenv("AUTOTUNE_ATTENTION_BUCKETS", "1")
    blocks = find_blocks(model)
    undo = compiling.install(model, blocks, recomputed)
    undo_checkpoints = (checkpointing.install(blocks, recomputed, offload_activations=False,
                                              placement=resolve_device("cpu"), inner=compiling.forward)
                        if recomputed else (lambda: None))
    before = int(counters["frames"]["ok"])
    try:
        for length in (32, 16, 24, 9):
            reached, built = _against_eager(model, eager, length)
            assert reached == {64}, f"length {length} reached attention unpadded"
            assert built == [1], "the padded mask was built again for another layer or the backward"
        assert int(counters["frames"]["ok"]) - before == 1, "a new length compiled another graph"
    finally:
        undo_checkpoints()
        undo()


@pytest.mark.slow  # seconds: Inductor compiles
def test_under_autocast_the_compiled_operator_trains_as_eager_attention_does(monkeypatch):
    """Under bf16 autocast (the operator casts its inputs as autocast casts torch's attention, and its backward
    runs without autocast): a compiled, padded GPT-2's losses and gradients are the unpadded eager ones, within
    bf16's rounding."""
    transformers = pytest.importorskip("transformers")
    from autotune.techniques import compile as compiling
    from autotune.techniques import find_blocks

    torch._dynamo.reset()
    model, eager = _tiny_gpt2(transformers, 64), _tiny_gpt2(transformers, 64)
    monkeypatch.setenv("AUTOTUNE_ATTENTION_BUCKETS", "1")
    restore = lengths.install("cpu")
    undo = compiling.install(model, find_blocks(model), 0)
    try:
        for length in (40, 23):
            ids = torch.randint(0, 97, (3, length), generator=torch.Generator().manual_seed(length))
            mask = torch.ones(3, length, dtype=torch.long)
            mask[1, -5:] = 0
            with pytest.MonkeyPatch.context() as spy, torch.autocast("cpu", torch.bfloat16):
                seen = _record(spy)
                got = model(input_ids=ids, attention_mask=mask, labels=ids).loss
            got.backward()
            assert {s[-2] for s in seen} == {64}
            restore()
            with torch.autocast("cpu", torch.bfloat16):
                want = eager(input_ids=ids, attention_mask=mask, labels=ids).loss
            want.backward()
            restore = lengths.install("cpu")
            torch.testing.assert_close(got, want, rtol=1e-3, atol=0)
            for (name, a), b in zip(model.named_parameters(), eager.parameters()):
                torch.testing.assert_close(a.grad, b.grad, rtol=0.05, atol=5e-3, msg=name)
    finally:
        undo()
        restore()


@pytest.mark.parametrize("case", ["causal", "float-mask"])
def test_the_operator_replays_the_forwards_dropout_in_its_backward(case):
    """The graph's operator: with dropout, its output and gradients equal the eager padded call's drawn from
    the same random state (its backward recomputes the attention from the state the forward drew from)."""
    length, kwargs = 13, CASES[case](13)
    want_in, got_in = _inputs(length), _inputs(length)
    torch.manual_seed(7)
    want = attention_padding.padded_call(*want_in, kwargs.get("attn_mask"), dropout_p=0.3,
                                         is_causal=kwargs.get("is_causal", False))
    torch.manual_seed(7)
    got = attention_op.padded_attention(*got_in, kwargs.get("attn_mask"), 0.3, kwargs.get("is_causal", False),
                                        None, False)
    torch.randn(100)  # the random state moves on before the backward, as the rest of a step moves it
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert (got == 0).any(), "no dropout was drawn"
    weights = torch.randn(want.shape, dtype=torch.float64)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    for a, b in zip(got_in, want_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["causal", "bool-mask"])
@pytest.mark.parametrize("path", ["eager", "operator"])
def test_on_cuda_in_bf16_the_padded_call_agrees_with_the_given_length(case, path):
    """Where torch takes cuDNN's (or another fused) kernel: bf16 outputs and gradients within bf16's rounding,
    padded in place (eager) or by the graph's operator."""
    length = 1000
    kwargs = CASES[case](length)
    kwargs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    g = torch.Generator(device="cuda").manual_seed(0)
    base = [torch.randn(2, 16, length, 64, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    want_in = [t.clone().requires_grad_() for t in base]
    got_in = [t.clone().requires_grad_() for t in base]
    want = TORCH_SDPA(*want_in, **kwargs)
    if path == "eager":
        got = attention_padding.padded_call(*got_in, kwargs.pop("attn_mask", None), **kwargs)
    else:
        got = attention_op.padded_attention(*got_in, kwargs.get("attn_mask"), 0.0, kwargs.get("is_causal", False),
                                            None, False)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    want.float().square().sum().backward()
    got.float().square().sum().backward()
    for a, b in zip(got_in, want_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=5e-2, atol=5e-2)


def _padded_gpt2(transformers) -> tuple[torch.nn.Module, torch.Tensor, dict[str, torch.Tensor]]:
    """A GPT-2 of 64 positions, and 8 samples of 64 token ids padded to 64, 50, 30, 64, 9, 64, 40, 20 tokens: the
    ids and the example (mask, labels -100 on padding). Its first sample is not padded."""
    model = _tiny_gpt2(transformers, 64)
    ids = torch.randint(0, 97, (8, 64), generator=torch.Generator().manual_seed(0))
    padding = (torch.arange(64)[None, :] < torch.tensor([64, 50, 30, 64, 9, 64, 40, 20])[:, None]).long()
    return model, ids, {"input_ids": ids, "attention_mask": padding, "labels": ids.masked_fill(padding == 0, -100)}


def _fit_bf16(model: torch.nn.Module, example: dict[str, torch.Tensor]):
    """`fit` on the simulated CPU device, bf16 only, one measured step a trial, no cache."""
    import autotune

    return autotune.fit(model, example, global_batch_size=8, device="cpu", cache=False, trial_steps=1,
                        memory_budget="1GiB", techniques=("bf16",))


@pytest.mark.parametrize("micro", [1, 2])
def test_a_step_at_a_trials_micro_batch_stays_under_that_trials_peak_on_padded_batches(micro: int):
    """A step over global batches of 8 at the micro-batch of one of fit's trials, every sample padded, peaks no
    higher than that trial did: the trial ran on a padded sample although the example's first is not (a padded
    micro-batch builds the attention mask an unpadded one skips), and the step holds nothing of the global
    batch's size beyond what the trial held (the label counts are read as numbers before the first forward)."""
    transformers = pytest.importorskip("transformers")

    model, ids, example = _padded_gpt2(transformers)
    plan = _fit_bf16(model, example)
    trial = next(t for t in plan.trials if t.outcome == "ok" and t.micro_batch_size == micro and t.rung == plan.rung)
    at_micro = plan.with_config(micro_batch_size=micro, accumulation_steps=8 // micro, last_micro_batch_size=micro)
    with at_micro.apply(model, torch.optim.AdamW(model.parameters(), lr=1e-3)) as step:
        for kept in (63, 32, 1):
            mask = (torch.arange(64)[None, :] < kept).long().expand(8, 64)
            step({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
            assert 0 < step.last_peak_bytes <= trial.peak_bytes, kept


def test_a_plan_says_it_and_trains_padded_lengths_under_its_peak(monkeypatch):
    """Through `fit` and `plan.apply` (switched on for the CPU): the reason of a token model's plan says how
    attention runs, and lengths 16-64 train at the bucket's length under the peak the trials measured at 64."""
    transformers = pytest.importorskip("transformers")

    monkeypatch.setenv("AUTOTUNE_ATTENTION_BUCKETS", "1")
    model, ids, example = _padded_gpt2(transformers)
    plan = _fit_bf16(model, example)
    assert "multiple of 64 tokens" in plan.reason and "AUTOTUNE_ATTENTION_BUCKETS=0" in plan.reason
    seen = _record(monkeypatch)
    with plan.apply(model, torch.optim.AdamW(model.parameters(), lr=1e-3)) as step:
        for length in (16, 40, 64):
            # every sample padded: a micro-batch of full rows only has its all-ones mask dropped by the model, and
            # its causal call without a mask at the first length would reach attention as it is, by design
            kept = torch.randint(1, length, (8, 1), generator=torch.Generator().manual_seed(length))
            mask = (torch.arange(length)[None, :] < kept).long()
            batch = {"input_ids": ids[:, :length], "attention_mask": mask,
                     "labels": ids[:, :length].masked_fill(mask == 0, -100)}
            step(batch)
            assert step.last_peak_bytes <= plan.peak_memory_bytes, length
    assert seen and {s[-2] for s in seen} == {64}, "a length reached attention unpadded"
    assert F.scaled_dot_product_attention is TORCH_SDPA  # the plan's exit put torch's function back

    monkeypatch.setenv("AUTOTUNE_ATTENTION_BUCKETS", "0")
    plan = _fit_bf16(model, example)
    assert "multiple of 64" not in plan.reason


def _windowed_mask(length: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """A sliding window of 2 tokens each side over a padding mask (sample 1 has 4 real tokens), as ModernBERT
    builds it: sample 1's padding rows past its window see no key at all."""
    pos = torch.arange(length, device=device)
    real = pos[None, :] < torch.tensor([length, 4], device=device)[:, None]
    near = (pos[:, None] - pos[None, :]).abs() <= 2
    mask = near[None, None] & real[:, None, None, :]
    if dtype == torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float64])
def test_a_query_row_the_mask_hides_entirely_sees_the_real_keys_and_no_real_gradient_changes(dtype):
    length = 13
    mask = _windowed_mask(length, dtype)
    dead = ~(mask if dtype == torch.bool else mask > torch.finfo(dtype).min).any(-1)
    assert dead.any(), "the case must hold rows that see no key"
    padded = attention_padding._padded_mask(mask, length, 64 - length)
    visible = padded if dtype == torch.bool else padded > torch.finfo(dtype).min
    assert visible.any(-1).all(), "a padded mask keeps a row that sees no key (cuDNN returns NaN for it)"
    assert not visible[..., length:].any(), "a padded key became visible"
    want_in, got_in = _inputs(length), _inputs(length)
    want = TORCH_SDPA(*want_in, attn_mask=mask)
    got = attention_padding.padded_call(*got_in, mask)
    live = ~dead[..., None]  # the rows a model's loss can reach
    torch.testing.assert_close(got * live, want * live, rtol=0, atol=1e-12)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * live
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    for a, b in zip(got_in, want_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", ["eager", "operator"])
def test_on_cuda_a_row_the_mask_hides_entirely_leaves_every_gradient_finite(path):
    length = 1000
    mask = _windowed_mask(length, torch.bfloat16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(2, 16, length, 64, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
              for _ in range(3)]
    if path == "eager":
        out = attention_padding.padded_call(*inputs, mask)
    else:
        out = attention_op.padded_attention(*inputs, mask, 0.0, False, None, False)
    out.float().square().sum().backward()
    assert torch.isfinite(out).all()
    for t in inputs:
        assert torch.isfinite(t.grad).all()


@pytest.mark.slow  # seconds: Inductor compiles
def test_compiled_attention_is_padded_no_further_than_the_plans_length(monkeypatch):
    """Compiled per block, with the plan's length 30 (not a multiple of 64): lengths up to 30 reach torch's
    kernel at 30, the last bucket cut there, and a longer one at its own bucket; one graph serves them all, and
    each loss and gradient is the unpadded eager one."""
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    from autotune.techniques import compile as compiling
    from autotune.techniques import find_blocks

    torch._dynamo.reset()
    model, eager = _tiny_gpt2(transformers, 64).double(), _tiny_gpt2(transformers, 64).double()
    monkeypatch.setenv("AUTOTUNE_ATTENTION_BUCKETS", "1")
    undo = compiling.install(model, find_blocks(model), 0)
    before = int(counters["frames"]["ok"])
    try:
        for length, reached in ((30, 30), (16, 30), (9, 30), (40, 64)):
            assert _against_eager(model, eager, length, longest=30)[0] == {reached}, length
        assert int(counters["frames"]["ok"]) - before == 1, "a new length compiled another graph"
    finally:
        undo()


def test_a_step_accumulating_micro_batches_stays_under_its_trials_peak_on_a_llama():
    """A Llama over padded batches of 4 at micro-batch 2 (two micro-steps): from its second micro-step on, the step
    holds the running loss and count totals, 8-byte scalars a trial of one micro-batch held nowhere until the trial
    held them from its start too; every step peaks no higher than the trial at that micro-batch."""
    transformers = pytest.importorskip("transformers")
    import autotune

    torch.manual_seed(17)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256))
    generator = torch.Generator().manual_seed(0)

    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 97, (4, 64), generator=generator)
        kept = torch.randint(1, 65, (4,), generator=generator)
        kept[0] = 64
        mask = (torch.arange(64)[None, :] < kept[:, None]).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    plan = autotune.fit(model, batch(), global_batch_size=4, device="cpu", cache=False, trial_steps=1,
                        memory_budget="4GiB", techniques=("bf16",))
    trial = next(t for t in plan.trials if t.fits and t.micro_batch_size == 2 and t.rung == plan.rung)
    at_two = plan.with_config(micro_batch_size=2, accumulation_steps=2, last_micro_batch_size=2)
    with at_two.apply(model, torch.optim.AdamW(model.parameters(), lr=1e-4)) as step:
        for _ in range(3):
            step(batch())
            assert 0 < step.last_peak_bytes <= trial.peak_bytes, (step.last_peak_bytes, trial.peak_bytes)
