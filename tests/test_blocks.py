"""Which blocks checkpointing recomputes, on the models people bring.

Real models on the CPU: tiny Hugging Face T5, Llama and GPT-2; a model holding its blocks as attributes; a
torchvision-style ResNet. Plus the reason texts, sizes in their unit, and the shared-tensor mark.
"""

from __future__ import annotations

import gc
import json
import warnings

import pytest
import torch
import transformers
from torch import nn

import autotune
from autotune.configuration import Rung
from autotune.devices.placement import resolve_device
from autotune.evidence import Trial
from autotune.plan import Plan
from autotune.search.controller import Controller
from autotune.search.placement import blocks_needed
from autotune.search.trial import TrialRunner, Workload
from autotune.sizes import format_bytes
from autotune.techniques import apply_rung, checkpointing, find_blocks, profile_blocks
from autotune.workload import batch as batches
from autotune.workload.batching import global_step_seconds
from autotune.workload.losses import resolve
from autotune.workload.optimizers import OptimizerSpec

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest.py

CPU = resolve_device("cpu")


def _wrapped(model: nn.Module) -> set[str]:
    """Paths of the modules whose forward autotune's checkpointing wrapped."""
    return {path for path, m in model.named_modules() if "forward" in m.__dict__}


# -- T5: encoder and decoder --------------------------------------------------------------------------------
def tiny_t5() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=3,
                                   num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).double()
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(1, 64, (4, 10), generator=g),
             "labels": torch.randint(1, 64, (4, 7), generator=g)}
    return model, batch


def _grads(model: nn.Module, batch) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_t5_gets_its_encoder_and_its_decoder_blocks_both_recomputed():
    model, batch = tiny_t5()
    assert len(find_blocks(model).paths) == 5  # found from the structure alone too (a plan built by hand)
    blocks = profile_blocks(model, batch, resolve(None), CPU)
    assert blocks is not None
    assert sorted(blocks.paths) == ["decoder.block.0", "decoder.block.1", "decoder.block.2",
                                    "encoder.block.0", "encoder.block.1"]  # N counts both groups
    # Decoder blocks hold more (cross-attention besides self-attention): recomputed first when k < N.
    assert all(p.startswith("decoder") for p in blocks.paths[:3])
    assert blocks.held[0] > blocks.held[-1] > 0
    expected = _grads(model, batch)
    applied = apply_rung(model, Rung(checkpointing="full", checkpointed_blocks=5), OptimizerSpec.from_user(None, model),
                         CPU, blocks)
    try:
        assert _wrapped(model) == set(blocks.paths)
        got = _grads(model, batch)  # the recompute runs the same float64 arithmetic
    finally:
        applied.remove()
    assert not _wrapped(model)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


# -- blocks held as attributes ------------------------------------------------------------------------------
class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class AttributeBlocks(nn.Module):
    """Four blocks as plain attributes, no ModuleList: the block finder finds them too."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.b1, self.b2, self.b3, self.b4 = (MLPBlock(width) for _ in range(4))
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        return self.out(self.b4(self.b3(self.b2(self.b1(self.inp(x)))))).pow(2).mean()


def _peak_at_one(model, batch, rung, blocks=None) -> int:
    blocks = blocks if blocks is not None else find_blocks(model)
    work = Workload(model=model, batch=batch, loss_fn=resolve(None), spec=OptimizerSpec.from_user(None, model),
                    placement=CPU, budget_bytes=2**40, limit_bytes=2**40, per_rank=8, blocks=blocks,
                    measured_steps=1)
    return TrialRunner(work)(rung, 1).peak_bytes


def test_blocks_held_as_attributes_get_checkpointing():
    torch.manual_seed(0)
    model, batch = AttributeBlocks(), torch.randn(8, 8)
    found = find_blocks(model)
    assert found is not None and sorted(found.paths) == ["b1", "b2", "b3", "b4"] and found.path == "{b1,b2,b3,b4}"
    plain = _peak_at_one(model, batch, Rung())
    full = _peak_at_one(model, batch, Rung(checkpointing="full"))
    assert full < plain  # the premise: recomputing the attribute blocks saves memory at micro-batch 1
    # A limit between the two: no configuration without recompute fits, some recompute does.
    budget = int((plain + full) / 2 / 0.9)
    plan = autotune.fit(model, batch, global_batch_size=8, memory_budget=budget, device="cpu", cache=False,
                        trial_steps=1, techniques=("bf16", "checkpointing"))
    assert plan.checkpointing != "none" and plan.checkpointed_blocks > 0
    assert sorted(plan.block_paths) == ["b1", "b2", "b3", "b4"]
    with plan.apply(model) as step:  # training recomputes the planned blocks, the first of the plan's order
        assert _wrapped(model) == set(plan.block_paths[:plan.checkpointed_blocks])
        step(batch)
    assert not _wrapped(model)


def test_block_paths_survive_json_and_a_model_that_lacks_them_is_searched_again(caplog):
    torch.manual_seed(0)
    model = AttributeBlocks()
    plan = Plan.of(precision="fp32", checkpointing="selective", checkpointed_blocks=2, offload="none",
                micro_batch_size=4, accumulation_steps=1, world_size=1, global_batch_size=4, last_micro_batch_size=4,
                peak_memory_bytes=0,
                memory_budget_bytes=2**30, margin=0.1, samples_per_second=1.0, device="cpu",
                block_paths=("b4", "b1", "b2", "b3"))
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and again.block_paths == ("b4", "b1", "b2", "b3")
    with again.apply(model) as step:  # the plan's order, not the structure's: b4 and b1
        assert _wrapped(model) == {"b4", "b1"}
        step(torch.randn(4, 8))
    renamed = plan.with_config(block_paths=("module.b4", "module.b1", "module.b2", "module.b3"))
    with caplog.at_level("WARNING"), renamed.apply(model):
        assert len(_wrapped(model)) == 2  # found again from the model, two of its four blocks
    assert "block_paths name module.b4" in caplog.text


# -- a model whose library checkpoints already --------------------------------------------------------------
def tiny_llama() -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_hugging_face_checkpointing_already_on_is_reported_and_not_stacked():
    model = tiny_llama()
    ids = torch.randint(1, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    assert find_blocks(model) is not None and not find_blocks(model).library  # off: autotune's own blocks
    # gradient_checkpointing_enable() was renamed activation_checkpointing_enable() in transformers 5.
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    plan = autotune.fit(model, batch, global_batch_size=4, memory_budget="1GiB", device="cpu", cache=False,
                        trial_steps=1, max_trials=4)
    assert "Hugging Face gradient checkpointing is on" in plan.reason, plan.reason
    assert plan.checkpointing == "none" and plan.block_paths == ()
    assert all(t.rung.checkpointing == "none" for t in plan.trials)  # nothing of autotune's on top of it
    # A plan that says to recompute (tuned elsewhere, or by hand) does not wrap the blocks a second time.
    for count in (2, None):  # None: the label's default, which counts no block of autotune's here
        forced = plan.with_config(checkpointing="full", checkpointed_blocks=count)
        with forced.apply(model) as step:
            assert not _wrapped(model)
            assert step(batch) > 0


# -- a model without repeated blocks --------------------------------------------------------------------------
def test_a_plan_that_checkpoints_a_model_without_repeated_blocks_is_refused_saying_so():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    assert find_blocks(model) is None
    plan = autotune.fit(model, torch.randn(8, 8), global_batch_size=8, memory_budget="1GiB", device="cpu",
                        cache=False, trial_steps=1, max_trials=4, loss_fn=lambda m, b: m(b).square().mean())
    assert plan.checkpointing == "none" and "checkpointing skipped: no repeated blocks" in plan.reason, plan.reason
    for knobs in ({"checkpointing": "full", "checkpointed_blocks": None},
                  {"checkpointing": "selective", "checkpointed_blocks": None},
                  {"checkpointing": "selective", "checkpointed_blocks": 1}):
        with pytest.raises(autotune.InvalidSetting, match=r"recomputes blocks .* has no repeated blocks .* "
                                                          r"checkpointing='none'"):
            plan.with_config(**knobs).apply(model, loss_fn=lambda m, b: m(b).square().mean())


# -- ALBERT: one layer called at every depth ------------------------------------------------------------------
SHARED_LAYER = "albert.encoder.albert_layer_groups.0"  # ALBERT's one layer group, called num_hidden_layers times


def tiny_albert() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.AlbertConfig(vocab_size=64, embedding_size=8, hidden_size=16, num_hidden_layers=6,
                                       num_attention_heads=2, intermediate_size=32, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.AlbertForMaskedLM(config).double()
    ids = torch.randint(1, 64, (8, 10), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def _runs_of(module: nn.Module) -> list[int]:
    """A list that grows by one at each call of `module` (forward, or a recompute in backward)."""
    runs: list[int] = []
    module.register_forward_pre_hook(lambda *_: runs.append(1))
    return runs


def test_each_call_of_albert_s_shared_layer_can_be_recomputed_with_exact_gradients():
    model, batch = tiny_albert()
    assert find_blocks(model) is None  # no two same-class children: one layer group, called at 6 depths
    blocks = profile_blocks(model, batch, resolve(None), CPU)
    assert blocks is not None and sorted(blocks.paths) == [f"{SHARED_LAYER}#{i}" for i in range(6)]
    runs = _runs_of(model.get_submodule(f"{SHARED_LAYER}.albert_layers.0"))
    want = _grads(model, batch)
    for k in (1, 3, 6):
        runs.clear()
        remove = checkpointing.install(blocks, k, offload_activations=False, placement=CPU)
        try:
            got = _grads(model, batch)
        finally:
            remove()
        assert len(runs) == 6 + k  # six calls in forward, k of them again in backward
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_fit_checkpoints_albert_s_shared_layer_and_training_recomputes_its_calls():
    model, batch = tiny_albert()
    blocks = profile_blocks(model, batch, resolve(None), CPU)
    plain, full = (_peak_at_one(model, batch, rung, blocks) for rung in (Rung(), Rung(checkpointing="full")))
    assert full < plain  # the premise: recomputing the shared layer's calls saves memory at micro-batch 1
    budget = int((plain + full) / 2 / 0.9)  # nothing without recompute fits, some recompute does
    plan = autotune.fit(model, batch, global_batch_size=8, memory_budget=budget, device="cpu", cache=False,
                        trial_steps=1, techniques=("bf16", "checkpointing"))
    assert plan.checkpointed_blocks > 0 and sorted(plan.block_paths) == sorted(blocks.paths), plan.reason
    runs = _runs_of(model.get_submodule(f"{SHARED_LAYER}.albert_layers.0"))
    with plan.apply(model) as step:
        step(batch)
    assert len(runs) == plan.accumulation_steps * 6 + plan.accumulation_steps * plan.checkpointed_blocks


# -- ResNet: every stage --------------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    """torchvision's ResNet-18 block: two 3x3 convolutions, batch norm, a projection where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x):
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNetLike(nn.Module):
    """torchvision's layout (conv1, bn1, layer1..layer4 as Sequentials of blocks, fc), 32x32 inputs."""

    def __init__(self, widths: tuple[int, ...] = (8, 16, 32, 64)) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        cin = widths[0]
        for i, w in enumerate(widths, start=1):
            setattr(self, f"layer{i}", nn.Sequential(BasicBlock(cin, w, 1 if i == 1 else 2), BasicBlock(w, w, 1)))
            cin = w
        self.fc = nn.Linear(cin, 10)

    def forward(self, x, y):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return nn.functional.cross_entropy(self.fc(x.mean((2, 3))), y)


def test_a_resnet_gets_every_stage_recomputed_early_stages_first():
    torch.manual_seed(0)
    model = ResNetLike()
    batch = (torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))
    params = {i: sum(p.numel() for p in getattr(model, f"layer{i}").parameters()) for i in range(1, 5)}
    assert max(params, key=params.get) == 4  # by parameters layer4 alone would win
    stats = [b.clone() for b in model.buffers()]
    blocks = profile_blocks(model, batch, resolve(None), CPU)
    assert blocks is not None
    assert sorted(blocks.paths) == sorted(f"layer{i}.{j}" for i in range(1, 5) for j in range(2))  # all 8
    # By the activations held: a layer1 block keeps 8 channels at 32x32 per sample, a layer4 block 64 at 4x4.
    stage = [int(p[5]) for p in blocks.paths]
    assert stage == sorted(stage)
    assert blocks.held[0] > 4 * blocks.held[-1]
    shares = blocks.shares()
    assert shares is not None and shares[2] > 2 / 8 and shares[-1] == 1.0
    # The profile is one forward: the caller's snapshot restores what it touched; here it was BN statistics.
    assert any(not torch.equal(a, b) for a, b in zip(stats, model.buffers()))


def test_the_profile_leaves_no_activation_alive():
    # A pack hook that returned the saved tensor itself leaked the whole forward graph (a saved output
    # points at its own grad_fn): the first trial then measured the profile's activations as its own.
    torch.manual_seed(0)
    model, batch = AttributeBlocks(), torch.randn(4, 8)

    def alive() -> set[int]:
        gc.collect()
        with warnings.catch_warnings():  # isinstance on every object touches torch's deprecated aliases
            warnings.simplefilter("ignore")
            return {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None}

    before = alive()
    blocks = profile_blocks(model, batch, resolve(None), CPU)
    assert blocks is not None and sum(blocks.held) > 0
    assert alive() - before == set()


def test_the_controller_needs_fewer_blocks_when_the_first_ones_hold_the_most():
    # 8 blocks saving 8 GiB per sample in all; the first two hold half of it (a ResNet's layer1).
    shares = (0.0, 0.25, 0.5, 0.6, 0.7, 0.8, 0.87, 0.94, 1.0)
    args = dict(floor=2 * 2**30, s0=9 * 2**30, sn=1 * 2**30, n=8, micro=2, limit=15 * 2**30, compiled=1.0)
    # 2 + 2 x (9 - 8 f) <= 15 GiB needs a share f >= 5/16 of the saving: k/n says 3 blocks, the shares 2.
    assert blocks_needed(**args) == 3
    assert blocks_needed(**args, shares=shares) == 2


# -- reasons and sizes ------------------------------------------------------------------------------------------
def test_reason_says_lighter_configurations_fitted_but_were_slower_in_mib():
    full, offload = Rung(checkpointing="full"), Rung(checkpointing="full", offload="optimizer")
    limit = 200 * 2**20  # a MiB budget: "0.20 GiB" would hide it
    # (resident floor, bytes per sample, optimizer seconds): full recompute fits 2 samples, with the
    # optimizer on the host 8; micro-steps are launch-bound, so 8 at once wins despite the host step.
    shape = {Rung(): (190, 20, 0.0), full: (150, 20, 0.0), offload: (20, 20, 0.05)}

    def runner(rung: Rung, micro: int) -> Trial:
        fixed, per_sample, opt = shape[rung]
        peak = (fixed + micro * per_sample) * 2**20
        if peak > limit:
            return Trial(rung=rung, micro_batch_size=micro, outcome="oom", peak_bytes=limit)
        step = 0.1 + 0.001 * micro
        rate = 8 / global_step_seconds(step, opt, 8, micro)
        return Trial(rung=rung, micro_batch_size=micro, outcome="ok", peak_bytes=peak, step_seconds=step,
                     optimizer_seconds=opt, samples_per_second=rate)

    result = Controller(runner, per_rank=8, limit_bytes=limit).search([Rung(), full, offload])
    assert result.picked().rung == offload and result.picked().micro_batch_size == 8
    slower = max((t for t in result.trials if t.fits and t.rung == full), key=lambda t: t.samples_per_second)
    ratio = result.picked().samples_per_second / slower.samples_per_second
    assert ratio > 1.3  # the premise
    assert f"bf16+full ckpt at micro-batch {slower.micro_batch_size} fitted but {ratio:.2f}x slower" in result.head
    assert "(200.0 MiB)" in result.head and "nothing lighter fits" not in result.head, result.head


def test_sizes_print_in_the_unit_that_fits():
    assert format_bytes(40 * 2**20) == "40.0 MiB" and format_bytes(int(23.5 * 2**30)) == "23.50 GiB"
    plan = Plan.of(precision="bf16", checkpointing="none", offload="none", micro_batch_size=4, accumulation_steps=1,
                world_size=1, global_batch_size=4, last_micro_batch_size=4, peak_memory_bytes=12 * 2**20,
                memory_budget_bytes=40 * 2**20, margin=0.1, samples_per_second=1.0)
    assert "peak 12.0 MiB of 40.0 MiB" in plan.summary()


# -- a tensor that is not a batch ---------------------------------------------------------------------------
class BiasedModel(nn.Module):
    """Adds a (4, 4) table every sample uses; records the shape it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.seen: list[tuple[int, ...]] = []

    def forward(self, x, table):
        self.seen.append(tuple(table.shape))
        return (self.lin(x) @ table).pow(2).mean()


def test_a_tensor_marked_shared_reaches_every_micro_batch_whole():
    torch.manual_seed(0)
    x, table = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    batch = (x, autotune.Shared(table))  # dim 0 of the table equals the batch size: without the mark, sliced
    assert batches.batch_size(batch) == 4
    assert batches.take(batch, 0, 2)[1] is batch[1]  # never sliced
    assert ("[1](shared)", (4, 4), "float64") in batches.signature(batch)
    model = BiasedModel()
    reference = BiasedModel()
    reference.load_state_dict(model.state_dict())
    reference(x, table).backward()
    plan = Plan.of(precision="fp32", checkpointing="none", offload="none", micro_batch_size=2, accumulation_steps=2,
                world_size=1, global_batch_size=4, last_micro_batch_size=2, peak_memory_bytes=0,
                memory_budget_bytes=2**30, margin=0.1, samples_per_second=1.0, device="cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with plan.apply(model, optimizer) as step:
        step(batch)
    assert model.seen == [(4, 4), (4, 4)]  # both micro-batches got the whole table, as a plain tensor
    with torch.no_grad():
        for p, r in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p, r - 0.1 * r.grad, atol=1e-12, rtol=0)  # the full-batch step


def test_a_tensor_whose_first_dimension_differs_is_refused_with_the_mark_named():
    with pytest.raises(autotune.InvalidSetting, match=r"autotune\.Shared\(tensor\)"):
        batches.batch_size((torch.randn(4, 3), torch.randn(5, 5)))
    with pytest.raises(autotune.InvalidSetting, match="marks a tensor"):
        autotune.Shared([1, 2])
