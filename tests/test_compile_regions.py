"""Compile per repeated block: one graph for every block and every micro-batch size (CPU, Inductor).

The search leaves compile out on the simulated CPU device, so these tests put the knob on directly, as
`plan.apply` does, and count what torch compiled."""

from __future__ import annotations

import pytest
import torch

from autotune.errors import InvalidSetting
from autotune.techniques import compile as compiling
from autotune.techniques import find_blocks

transformers = pytest.importorskip("transformers")


def _gpt2(n_layer: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=97, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _frames() -> int:
    from torch._dynamo.utils import counters
    return int(counters["frames"]["ok"])


def test_blocks_compile_once_for_all_blocks_and_sizes_and_match_eager():
    torch._dynamo.reset()
    model, eager = _gpt2(), _gpt2()
    undo = compiling.install(model, find_blocks(model), 0)
    before = _frames()
    try:
        assert model.config.use_cache is False  # a per-layer KV cache would give each block its own graph
        for size in (2, 5, 3):
            ids = torch.randint(0, 97, (size, 12), generator=torch.Generator().manual_seed(size))
            got, want = model(input_ids=ids, labels=ids).loss, eager(input_ids=ids, labels=ids).loss
            assert got.item() == pytest.approx(want.item(), rel=1e-4)
        assert _frames() - before == 1, "each block or size compiled a graph of its own"
        assert all(b._compiled_call_impl is not None for b in find_blocks(model).blocks)
        assert model._compiled_call_impl is None  # the rest of the model stays eager
    finally:
        undo()
    assert model.config.use_cache is True
    assert all(b._compiled_call_impl is None for b in find_blocks(model).blocks)


def test_whole_model_is_compiled_on_request(monkeypatch):
    monkeypatch.setenv("AUTOTUNE_COMPILE_REGIONS", "whole")
    model = _gpt2(2)
    undo = compiling.install(model, find_blocks(model), 0)
    try:
        assert model._compiled_call_impl is not None
        assert all(b._compiled_call_impl is None for b in find_blocks(model).blocks)
    finally:
        undo()
    assert model._compiled_call_impl is None


def test_a_bad_regions_setting_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("AUTOTUNE_COMPILE_REGIONS", "layers")
    with pytest.raises(InvalidSetting, match=r"AUTOTUNE_COMPILE_REGIONS.*'blocks' or 'whole'"):
        compiling.install(_gpt2(2), None, 0)
