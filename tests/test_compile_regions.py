"""Compile per repeated block: one graph for every block and every micro-batch size (CPU, Inductor).

The search leaves compile out on the simulated CPU device, so these tests put the knob on directly, as
`plan.apply` does, and count what torch compiled."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from autotune.errors import InvalidSetting
from autotune.techniques import BlockGroup, find_blocks
from autotune.techniques import compile as compiling

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


def _grads_and_saved(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every parameter's gradient after one forward and backward (seeded: dropout is on), and how many
    bytes autograd saved outside any checkpoint during the forward."""
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    torch.manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), saved[0]


@pytest.mark.parametrize("recomputed", [2, 4])
def test_a_recomputed_block_is_compiled_inside_its_checkpoint_with_the_gradients_of_no_recompute(recomputed):
    """Compile with recompute, as `apply_rung` puts them together: the recomputed blocks run their compiled
    forward inside the checkpoint (Inductor never traces a checkpoint), the others are compiled as usual.
    The gradients are bitwise those of the compiled model without recompute, dropout included (the
    checkpoint restores the RNG state Inductor draws its seeds from), and the checkpoint did drop what
    the compiled blocks would have kept."""
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(0))
    plain, recomputing, blocks, undo = compiled_pair(recomputed)
    try:
        assert [b._compiled_call_impl is None for b in blocks.blocks] == [i < recomputed for i in range(4)]
        want, kept = _grads_and_saved(plain, ids)
        got, kept_recomputing = _grads_and_saved(recomputing, ids)
        assert torch.equal(got, want)
        assert kept_recomputing < kept * (1 - 0.5 * recomputed / 4)
    finally:
        for fn in reversed(undo):
            fn()
    assert all("forward" not in b.__dict__ and b._compiled_call_impl is None for b in blocks.blocks)


def compiled_pair(recomputed: int) -> tuple[torch.nn.Module, torch.nn.Module, BlockGroup, list[Callable[[], None]]]:
    """Two GPT-2s of 4 blocks with the same weights (dropout on), both compiled as `apply_rung` compiles them: one
    recomputing none, the other its first `recomputed` blocks, each compiled inside its checkpoint; the second's
    blocks and the undo functions (undo in reverse)."""
    from autotune.devices.placement import Placement
    from autotune.techniques import checkpointing

    torch._dynamo.reset()
    cfg = dict(n_layer=4, n_embd=32, n_head=2, vocab_size=97, n_positions=32, resid_pdrop=0.1, attn_pdrop=0.1)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg)))
    plain, recomputing = models
    placement = Placement(kind="cpu", name="cpu (simulated ceiling)", total_bytes=2**34)
    blocks = find_blocks(recomputing)
    assert blocks is not None
    undo = [compiling.install(plain, find_blocks(plain), 0),
            checkpointing.install(blocks, recomputed, offload_activations=False, placement=placement,
                                  inner=compiling.forward),
            compiling.install(recomputing, blocks, recomputed)]
    return plain, recomputing, blocks, undo


def test_compiled_rungs_with_more_blocks_recomputed_follow_each_other_as_a_search_and_a_recovery_do():
    """`apply_rung` for compile with 0, 2 and 4 blocks recomputed, one after the other on one model (each
    undone before the next): every rung gives the compiled model's loss, each block is compiled in exactly
    one way (inside its checkpoint or as a whole call, never both), and the last undo leaves none."""
    from autotune.configuration import Rung
    from autotune.devices.placement import Placement
    from autotune.techniques import apply_rung
    from autotune.workload.optimizers import OptimizerSpec

    torch._dynamo.reset()
    model = _gpt2()
    placement = Placement(kind="cpu", name="cpu (simulated ceiling)", total_bytes=2**34)
    blocks = find_blocks(model)
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=ids, labels=ids).loss.item()
    for k in (0, 2, 4, 2):
        label = "none" if k == 0 else "full" if k == 4 else "selective"
        rung = Rung(precision="fp32", checkpointing=label, checkpointed_blocks=k, compile=True)
        applied = apply_rung(model, rung, OptimizerSpec.from_user(None, model), placement, blocks)
        try:
            recomputed = ["forward" in b.__dict__ for b in blocks.blocks]
            whole_call = [b._compiled_call_impl is not None for b in blocks.blocks]
            assert recomputed == [i < k for i in range(4)] and whole_call == [i >= k for i in range(4)], k
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            assert loss.item() == pytest.approx(want, rel=1e-4)
        finally:
            applied.remove()
            model.zero_grad(set_to_none=True)
    assert not any("forward" in b.__dict__ or b._compiled_call_impl is not None for b in blocks.blocks)


def test_every_sequence_length_runs_the_graph_compiled_for_the_first() -> None:
    """One graph for all blocks and all lengths (N = 1): the sequence dim is dynamic from the first call. Left
    to dynamo, the second length compiles a second graph (automatic dynamic shapes)."""
    torch._dynamo.reset()
    model, eager = _gpt2(), _gpt2()
    undo = compiling.install(model, find_blocks(model), 0)
    before = _frames()
    try:
        for size, length in ((4, 32), (3, 16), (4, 24), (2, 9), (4, 32)):
            ids = torch.randint(0, 97, (size, length), generator=torch.Generator().manual_seed(length))
            got, want = model(input_ids=ids, labels=ids).loss, eager(input_ids=ids, labels=ids).loss
            assert got.item() == pytest.approx(want.item(), rel=1e-4)
        assert _frames() - before == 1, "a new sequence length compiled another graph"
    finally:
        undo()


def test_a_compiled_plans_reason_says_how_many_graphs(monkeypatch) -> None:
    blocks = find_blocks(_gpt2())
    said = compiling.graphs_note(blocks, 0, True)
    assert said == ("compile: one graph per kind of repeated block for every micro-batch size and sequence length "
                    "(dynamic from the first call), and training compiles its own shape once more, static")
    monkeypatch.setenv("AUTOTUNE_COMPILE_STATIC", "0")
    assert compiling.graphs_note(blocks, 0, True).endswith("(dynamic from the first call)")
    monkeypatch.setenv("AUTOTUNE_COMPILE_REGIONS", "whole")
    assert compiling.graphs_note(blocks, 0, False).startswith("compile: one graph for the whole model for every "
                                                              "micro-batch size")
    assert "per kind of repeated block" in compiling.graphs_note(blocks, 2, True)  # recomputed: per block


def test_on_fsdp2_shards_each_unit_compiles_its_forward_and_gathers_outside_the_graph(tmp_path) -> None:
    """A sharded model (one gloo rank, in this process): each block's `forward` is compiled and FSDP2's
    gather and reshard stay in its eager `__call__`, with two blocks recomputed through their checkpoint and
    two not. One graph serves every block; the loss and the gradients are those of the sharded eager model."""
    import torch.distributed as dist

    from autotune.devices.placement import Placement
    from autotune.techniques import checkpointing
    from autotune.techniques.sharding import shard

    torch._dynamo.reset()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        compiled, eager = shard(_gpt2(), precision="fp32"), shard(_gpt2(), precision="fp32")
        blocks = find_blocks(compiled)
        placement = Placement(kind="cpu", name="cpu (simulated ceiling)", total_bytes=2**34)
        undo = [checkpointing.install(blocks, 2, offload_activations=False, placement=placement,
                                      inner=compiling.forward),
                compiling.install(compiled, blocks, 2)]
        before = _frames()
        try:
            assert all(b._compiled_call_impl is None for b in blocks.blocks)  # FSDP's hooks: eager
            assert ["forward" in b.__dict__ for b in blocks.blocks] == [True] * 4
            ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(0))
            losses = [m(input_ids=ids, labels=ids).loss for m in (compiled, eager)]
            for loss in losses:
                loss.backward()
            assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-5)
            for p, q in zip(compiled.parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), rtol=1e-4, atol=1e-6)
            assert _frames() - before <= 2  # one graph for every block (and one inside the checkpoints)
        finally:
            for fn in reversed(undo):
                fn()
        assert all("forward" not in b.__dict__ for b in blocks.blocks)
    finally:
        dist.destroy_process_group()


def test_a_compiled_model_is_freed_once_the_user_drops_it():
    """The compiled callables are kept per module for later trials and training (a block's whole call, as the
    whole model's is kept, and a recomputed block's forward); they must not keep the module: a model `fit`
    compiled would otherwise hold its weights (on a GPU, its memory) for good."""
    import gc
    import weakref

    model = _gpt2(2)
    blocks = find_blocks(model)
    undo = compiling.install(model, blocks, 0)
    recomputed = compiling.forward(blocks.blocks[0])  # what checkpointing runs for a recomputed block
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    recomputed(model.transformer.h[0].ln_1(model.transformer.wte(ids)))
    undo()
    weights, whole = weakref.ref(model.transformer.h[1].mlp.c_fc.weight), weakref.ref(model)
    del model, blocks, undo, recomputed
    gc.collect()
    assert whole() is None and weights() is None
