"""FP8 (`techniques=(..., "fp8")`): opt-in, left out with its reason where the device has no float8 matmul,
refused naming the extra where torchao is missing, and applied only to the linear layers whose shapes float8
serves."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import autotune
from autotune.configuration import Rung
from autotune.devices.placement import resolve_device
from autotune.techniques import fp8
from autotune.techniques.names import DEFAULT_TECHNIQUES, parse_techniques

pytestmark = pytest.mark.usefixtures("private_cache")


class Mixed(nn.Module):
    """Linear layers of servable and unservable shapes, nested, beside layers that are not linear."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)  # served
        self.odd_out = nn.Linear(64, 10)  # out features 10: left
        self.odd_in = nn.Linear(10, 48)  # in features 10: left
        self.inner = nn.Sequential(nn.Linear(48, 48, bias=False), nn.GELU(), nn.Linear(48, 24))  # served, left
        self.conv = nn.Conv1d(48, 48, 1)  # not linear: never converted
        self.norm = nn.LayerNorm(48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inner[0](self.odd_in(self.odd_out(self.up(x))))
        return self.inner[2](self.norm(self.conv(x.transpose(1, 2)).transpose(1, 2)))


def test_fp8_is_named_opt_in_and_an_unknown_technique_still_errors():
    assert parse_techniques(("bf16", "fp8")) == {"bf16", "fp8"}
    assert "fp8" not in DEFAULT_TECHNIQUES
    with pytest.raises(autotune.InvalidSetting, match=r"techniques: unknown 'fp9'.*fp8"):
        parse_techniques(("bf16", "fp9"))
    with pytest.raises(autotune.InvalidSetting, match="unknown 'float8'"):
        autotune.fit(nn.Linear(16, 16), torch.randn(4, 16), global_batch_size=4, device="cpu", cache=False,
                     techniques=("bf16", "float8"), loss_fn=lambda m, b: m(b).square().mean())


def test_the_layer_filter_picks_exactly_the_linear_layers_whose_features_divide_by_16():
    chosen = fp8.layers(Mixed())
    assert chosen.converted == ("up", "inner.0")
    assert chosen.left == ("odd_out", "odd_in", "inner.2")
    assert chosen.note() == ("fp8 tried on 2 of 5 linear layers (3 left in bf16: in or out features not divisible "
                             "by 16)")
    only_odd = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))
    assert fp8.layers(only_odd).converted == ()
    assert "fp8 left out: none of the model's 2 linear layers" in fp8.layers(only_odd).note()


def test_choosing_layers_and_checking_the_device_import_nothing_of_torchao():
    code = textwrap.dedent("""
        import sys
        from torch import nn
        from autotune.devices.placement import resolve_device
        from autotune.techniques import fp8
        model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 7))
        assert fp8.layers(model).converted == ("0",)
        assert fp8.unavailable(resolve_device("cpu")).startswith("fp8 left out")
        assert "torchao" not in sys.modules, "torchao was imported"
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_fp8_is_left_out_on_the_cpu_with_the_reason():
    from gpt import GPT, GPTConfig, random_batch

    assert fp8.unavailable(resolve_device("cpu")) == (
        "fp8 left out: float8 training needs a CUDA GPU of compute capability 8.9 or later (Ada, Hopper); "
        "this is cpu (simulated ceiling)")
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16, vocab_size=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    plan = autotune.fit(model, random_batch(cfg, 4), global_batch_size=4, device="cpu", cache=False,
                        trial_steps=1, memory_budget="1GiB", techniques=("bf16", "fp8"))
    assert "fp8 left out: float8 training needs a CUDA GPU of compute capability 8.9 or later" in plan.reason
    assert not plan.fp8 and "fp8" not in plan.rung.name
    assert plan.trials and not any(t.rung.fp8 for t in plan.trials)


def test_a_missing_torchao_is_refused_naming_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # what Python does for a package that cannot be imported
    with pytest.raises(autotune.InvalidSetting, match=r"'fp8' needs torchao.*pip install torchao.*\.\[fp8\]"):
        fp8.require()
    with pytest.raises(autotune.InvalidSetting, match="leave 'fp8' out of techniques"):
        fp8.install(Mixed())


def test_an_fp8_rung_is_bf16_and_says_fp8_in_its_name_and_round_trips():
    rung = Rung(precision="bf16", fp8=True, compile=True)
    assert rung.name == "bf16+compile+fp8"
    with pytest.raises(ValueError, match="Rung.fp8 .* use precision='bf16'"):
        Rung(precision="fp32", fp8=True)
    plan = autotune.Plan.of(rung=rung, micro_batch_size=2, accumulation_steps=2, world_size=1,
                            global_batch_size=4, last_micro_batch_size=2, memory_budget_bytes=2**30, margin=0.1)
    again = autotune.Plan.from_dict(plan.to_dict())
    assert again.fp8 and again.rung == rung


def test_install_converts_the_chosen_layers_on_the_same_parameters_and_undo_restores_them():
    """Where torchao is installed: the chosen layers become `Float8Linear` holding the user's own parameters
    (the optimizer and state dict see them), the others stay; the undo puts the original modules back."""
    Float8Linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear
    model = Mixed()
    before = dict(model.named_modules())
    weights = {name: p for name, p in model.named_parameters()}
    undo = fp8.install(model)
    try:
        after = dict(model.named_modules())
        assert {n for n, m in after.items() if isinstance(m, Float8Linear)} == {"up", "inner.0"}
        assert all(after[n] is before[n] for n in ("odd_out", "odd_in", "inner.2", "conv"))
        assert {name: p for name, p in model.named_parameters()} == weights
        assert all(a is b for a, b in zip(dict(model.named_parameters()).values(), weights.values()))
    finally:
        undo()
    assert dict(model.named_modules()) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_fp8_is_measured_beside_bf16_or_left_out_by_capability():
    """On a GPU of compute capability 8.9 or later the search measures fp8 twins beside the bf16
    configurations; below it, fp8 is left out with the GPU's capability in the reason."""
    from gpt import GPT, GPTConfig, random_batch

    cfg = GPTConfig(n_layer=2, n_embd=128, n_head=4, seq_len=128, vocab_size=512)
    model = GPT(cfg).cuda()
    placement = resolve_device("cuda")
    plan = autotune.fit(model, random_batch(cfg, 16), global_batch_size=16, device="cuda", cache=False,
                        trial_steps=2, techniques=("bf16", "fp8"))
    if torch.cuda.get_device_capability() < fp8.MIN_CAPABILITY:
        assert fp8.unavailable(placement) in plan.reason
        return
    pytest.importorskip("torchao.float8")
    assert any(t.rung.fp8 for t in plan.trials) and any(not t.rung.fp8 for t in plan.trials)
    assert "fp8 tried on 9 of 9 linear layers" in plan.reason
    assert ("fp8" in plan.rung.name) == plan.fp8


def test_an_fp8_rung_trains_a_recomputed_step_and_its_removal_restores_the_layers():
    """Where torchao is installed (its float8 matmul runs on the CPU too): `apply_rung` converts the layers
    before checkpointing wraps the blocks, a bf16 step trains through them, and the removal restores them."""
    pytest.importorskip("torchao.float8")
    from gpt import GPT, GPTConfig, random_batch

    from autotune.techniques import apply_rung, find_blocks
    from autotune.workload.optimizers import OptimizerSpec

    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16, vocab_size=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    spec = OptimizerSpec.from_user(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    applied = apply_rung(model, Rung(precision="bf16", fp8=True, checkpointing="full"), spec,
                         resolve_device("cpu"), find_blocks(model))
    try:
        assert {type(m).__name__ for m in (model.blocks[0].qkv, model.blocks[1].mlp[2], model.head)} == {
            "Float8Linear"}
        ids, labels = random_batch(cfg, 4)
        with applied.autocast():
            loss = model(**applied.inputs({"input_ids": ids, "labels": labels}))
        applied.backward(loss)
        applied.optimizer_step()
        assert torch.isfinite(loss)
    finally:
        applied.remove()
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, start[k])]
    assert "blocks.0.qkv.weight" in moved and "head.weight" in moved, "the step did not train the user's weights"


def tiny_gpt2() -> nn.Module:
    """Transformers' GPT-2, small: its attention and MLP are `Conv1D` layers (32 and 128 features, served); its
    head's 50 outputs are not."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=50)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def test_gpt2s_conv1d_layers_are_chosen_by_their_features_and_the_head_left():
    chosen = fp8.layers(tiny_gpt2())
    per_block = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert chosen.converted == tuple(f"transformer.h.{i}.{name}" for i in range(2) for name in per_block)
    assert chosen.left == ("lm_head",)
    assert chosen.note() == ("fp8 tried on 8 of 9 linear layers (1 left in bf16: in or out features not divisible "
                             "by 16)")
    without = fp8.layers(tiny_gpt2(), conv1d=False)
    assert without.converted == () and len(without.left) == 9
    assert "a Conv1D, which this torchao's float8 cannot serve" in without.note()


def test_a_float8_conv1d_computes_what_a_float8_linear_holding_its_weight_transposed_computes():
    """The same float8 casts and matmuls as torchao's own layer on `W.t()`: output and both gradients bitwise
    (torchao's float8 matmul runs on the CPU too), on the user's own `Parameter`s."""
    float8 = pytest.importorskip("torchao.float8")
    from autotune.techniques.fp8_conv1d import Float8Conv1D
    conv = tiny_gpt2().transformer.h[0].mlp.c_fc  # weight (32, 128): in, out
    config = float8.Float8LinearConfig(pad_inner_dim=True)
    linear = nn.Linear(32, 128)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    linear = float8.float8_linear.Float8Linear.from_float(linear, config)
    layer = Float8Conv1D(conv, config)
    assert layer.weight is conv.weight and layer.bias is conv.bias
    x = torch.randn(3, 5, 32, dtype=torch.float32)
    x_conv, x_linear = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = layer(x_conv), linear(x_linear)
    assert out.shape == (3, 5, 128) and torch.equal(out, expected)
    assert not torch.allclose(out, conv(x), atol=1e-6), "the float8 layer rounded nothing: is it float8?"
    assert torch.allclose(out, conv(x), rtol=0.1, atol=0.05), "float8 is a rounding, not another function"
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    assert torch.equal(x_conv.grad, x_linear.grad)
    assert torch.equal(conv.weight.grad, linear.weight.grad.t())
    assert torch.equal(conv.bias.grad, linear.bias.grad)


def test_install_on_gpt2_swaps_its_conv1d_layers_keeps_the_state_dict_and_trains():
    pytest.importorskip("torchao.float8")
    from autotune.techniques.fp8_conv1d import Float8Conv1D
    model = tiny_gpt2()
    before = dict(model.named_modules())
    keys = list(model.state_dict())
    parameters = list(model.parameters())
    undo = fp8.install(model)
    try:
        swapped = {n for n, m in model.named_modules() if isinstance(m, Float8Conv1D)}
        assert swapped == set(fp8.layers(tiny_gpt2()).converted)
        assert list(model.state_dict()) == keys
        assert all(a is b for a, b in zip(model.parameters(), parameters, strict=True))
        ids = torch.randint(0, 50, (2, 16))
        start = model.transformer.h[1].mlp.c_fc.weight.detach().clone()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        assert not torch.equal(model.transformer.h[1].mlp.c_fc.weight, start)
    finally:
        undo()
    assert dict(model.named_modules()) == before


def test_a_torchao_without_the_conv1d_matmul_leaves_gpt2s_conv1d_layers_in_bf16(monkeypatch):
    pytest.importorskip("torchao.float8")
    from autotune.techniques import fp8_conv1d
    monkeypatch.setattr(fp8_conv1d, "_internals", lambda: None)
    model = tiny_gpt2()
    before = dict(model.named_modules())
    undo = fp8.install(model)
    assert dict(model.named_modules()) == before
    undo()
