"""The whole decision graph on the CPU under the simulated ceiling: real models, real trials, real OOMs."""

from __future__ import annotations

import copy

import pytest
import torch
from gpt import GPT, GPTConfig, random_batch
from torch import nn

import autotune
from autotune.configuration import Rung
from autotune.devices.ceiling import SimulatedCeiling
from autotune.devices.placement import resolve_device
from autotune.search.controller import NOISE
from autotune.search.floors import resident_floor
from autotune.search.trial import TrialRunner, Workload
from autotune.techniques import apply_rung, checkpointing, find_blocks
from autotune.workload.losses import resolve
from autotune.workload.optimizers import OptimizerSpec

CFG = GPTConfig(vocab_size=128, n_layer=4, n_embd=64, n_head=4, seq_len=64)
RUNGS = {
    "fp32": Rung(precision="fp32"),
    "bf16": Rung(),
    "selective": Rung(checkpointing="selective"),
    "full": Rung(checkpointing="full"),
    "activations": Rung(checkpointing="full", offload="activations"),
    "optimizer": Rung(checkpointing="full", offload="optimizer"),
}


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(CFG), random_batch(CFG, 4)


@pytest.fixture(scope="module")
def peaks(gpt):
    """Simulated peak bytes of each rung at micro-batch 4, with no ceiling in the way."""
    model, batch = gpt
    work = Workload(model=model, batch=batch, loss_fn=resolve(None), spec=OptimizerSpec.from_user(None, model),
                    placement=resolve_device("cpu"), budget_bytes=2**40, limit_bytes=2**40, per_rank=8,
                    blocks=find_blocks(model), measured_steps=1)
    runner = TrialRunner(work)
    return {name: runner(rung, 4).peak_bytes for name, rung in RUNGS.items()}


@pytest.mark.slow  # seconds: searches that run real trial steps
def test_each_rung_lowers_the_simulated_peak(peaks):
    order = ["fp32", "bf16", "selective", "full", "activations", "optimizer"]
    for lighter, heavier in zip(order[1:], order):
        assert peaks[lighter] < peaks[heavier], (lighter, heavier, peaks)


def _fit(model, batch, budget, **kw):
    return autotune.fit(model, batch, global_batch_size=8, memory_budget=int(budget), device="cpu", cache=False,
                        trial_steps=1, **kw)


@pytest.mark.slow  # seconds: searches that run real trial steps
def test_shrinking_budget_pushes_the_model_up_the_ladder(gpt, peaks):
    model, batch = gpt
    # Nothing forces a climb: plain bf16 fits, and the search grows it to the whole per-rank batch. Only bf16
    # is allowed here: on the CPU, optimizer offload steps on the same cores and ties plain bf16 within
    # timing noise, so which of the two wins at a roomy budget is a coin toss on a loaded machine.
    roomy = _fit(model, batch, peaks["bf16"] * 3, techniques=("bf16",))
    assert roomy.rung == Rung()
    assert any(t.fits and t.rung == Rung() and t.micro_batch_size == 8 for t in roomy.trials)
    # Which micro-batch wins is measured: on a CPU a tiny model's throughput is nearly flat, so the pick is
    # the fastest, or one within noise of it with a lower peak (headroom first).
    # After a runoff the pick is made between its two longer re-measurements: the last two trials, each
    # repeating a (rung, micro-batch) already tried.
    *earlier, a, b = roomy.trials
    tried = {(t.rung, t.micro_batch_size) for t in earlier}
    runoff = {(a.rung, a.micro_batch_size), (b.rung, b.micro_batch_size)} <= tried
    decided_from = [a, b] if runoff else roomy.trials
    fastest = max((t for t in decided_from if t.fits), key=lambda t: t.samples_per_second)
    assert roomy.samples_per_second >= fastest.samples_per_second * (1 - NOISE)
    assert roomy.micro_batch_size == fastest.micro_batch_size or roomy.peak_memory_bytes < fastest.peak_bytes
    assert roomy.micro_batch_size * roomy.accumulation_steps >= 8

    # bf16 no longer fits even at micro-batch 1; checkpointing does (which strength wins is measured)
    tight = _fit(model, batch, _peak_at_one(model, batch, Rung()) * 0.97 / 0.9, techniques=("bf16", "checkpointing"))
    assert tight.checkpointing in ("selective", "full") and tight.offload == "none"
    assert not any(t.fits and t.rung == Rung() for t in tight.trials)
    assert tight.peak_memory_bytes <= 0.9 * tight.memory_budget_bytes

    # below full checkpointing at micro-batch 1: only the offload of the optimizer is left
    one = _peak_at_one(model, batch, Rung(checkpointing="full"))
    cramped = _fit(model, batch, one * 0.97 / 0.9)
    assert cramped.offload == "optimizer"
    assert cramped.accumulation_steps * cramped.micro_batch_size >= 8

    floor = _peak_at_one(model, batch, Rung(checkpointing="full", offload="optimizer"))
    with pytest.raises(autotune.NoFeasiblePlan, match="no configuration fits") as err:
        _fit(model, batch, floor * 0.95 / 0.9)
    assert "bf16+full ckpt+optimizer offload" in {t.rung.name for t in err.value.trials}


def test_rungs_whose_weights_and_optimizer_state_alone_overflow_are_not_tried(gpt):
    # W2's shape (GPT-2 XL on 16 GiB): FP32 weights, gradients and AdamW state exceed the limit, so only
    # optimizer offload can fit, and a trial on a lower rung would only run out of memory.
    model, batch = gpt
    floor = resident_floor(Rung(), model, state_tensors=2)
    assert _peak_at_one(model, batch, RUNGS["optimizer"]) < 0.8 * floor  # the premise: offload fits under it
    plan = _fit(model, batch, floor)  # limit: 90% of the floor
    assert plan.offload == "optimizer"
    assert {t.rung.offload for t in plan.trials} == {"optimizer"}
    assert not any(t.outcome == "oom" for t in plan.trials)
    assert "bf16+full ckpt+activations offload skipped: weights, gradients and optimizer state alone" in plan.reason
    skipped = r"bf16, bf16\+full ckpt, .* skipped: weights, gradients and optimizer state alone need \d+ KiB"
    with pytest.raises(autotune.NoFeasiblePlan, match=skipped):
        _fit(model, batch, floor / 20)  # the top rung is still tried, and the error says why no other was


def _peak_at_one(model, batch, rung):
    work = Workload(model=model, batch=batch, loss_fn=resolve(None), spec=OptimizerSpec.from_user(None, model),
                    placement=resolve_device("cpu"), budget_bytes=2**40, limit_bytes=2**40, per_rank=8,
                    blocks=find_blocks(model), measured_steps=1)
    return TrialRunner(work)(rung, 1).peak_bytes


@pytest.mark.slow  # seconds: searches that run real trial steps
def test_fit_restores_weights_optimizer_state_grads_and_rng(gpt, peaks):
    model, batch = gpt
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(*batch).backward()
    optimizer.step()  # the user's optimizer now has state
    model.eval()
    weights = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(optimizer.state_dict())
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()

    _fit(model, batch, peaks["full"] * 1.02 / 0.9, optimizer=optimizer)

    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    after = optimizer.state_dict()
    for k, s in state["state"].items():
        assert all(torch.equal(s[n], after["state"][k][n]) for n in s)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert torch.equal(rng, torch.get_rng_state())
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all("forward" not in b.__dict__ for b in model.blocks)  # checkpointing wrappers removed
    for p in model.parameters():
        p.grad = None
    model.train()


class BNBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.bn(self.lin(x))))


class BNNet(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[BNBlock(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).pow(2).mean()


def _grads_and_stats(model, x, seed):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    model(x).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    stats = [b.clone() for b in model.buffers()]
    return grads, stats


def test_batchnorm_and_dropout_train_identically_with_and_without_checkpointing():
    torch.manual_seed(0)
    plain = BNNet().double()
    ckpt = copy.deepcopy(plain)
    x = torch.randn(32, 16, dtype=torch.float64)
    blocks = find_blocks(ckpt)
    assert blocks is not None and len(blocks.blocks) == 4
    remove = checkpointing.install(blocks, len(blocks.blocks), offload_activations=False,
                                   placement=resolve_device("cpu"))
    try:
        g1, s1 = _grads_and_stats(plain, x, seed=7)
        g2, s2 = _grads_and_stats(ckpt, x, seed=7)
    finally:
        remove()
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)  # dropout masks replayed on recompute
    for a, b in zip(s1, s2):
        assert torch.equal(a, b)  # running stats and num_batches_tracked updated once, not twice


def test_every_rung_trains_a_batchnorm_model():
    # Regression (ResNet-152 on an H100): optimizer offload cast BatchNorm's weights to bf16 beside its
    # FP32 running statistics, and backward refused the mix. Norm layers now keep FP32 device weights.
    torch.manual_seed(0)
    model = BNNet()
    work = Workload(model=model, batch=torch.randn(8, 16), loss_fn=resolve(None),
                    spec=OptimizerSpec.from_user(None, model), placement=resolve_device("cpu"), budget_bytes=2**40,
                    limit_bytes=2**40, per_rank=8, blocks=find_blocks(model), measured_steps=1)
    runner = TrialRunner(work)
    for rung in RUNGS.values():
        trial = runner(rung, 4)
        assert trial.fits, (rung.name, trial.note)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the offload undone

    applied = apply_rung(model, RUNGS["optimizer"], work.spec, work.placement, work.blocks)
    try:
        norms = {id(p) for b in model.blocks for p in b.bn.parameters()}
        for p in model.parameters():
            assert p.dtype == (torch.float32 if id(p) in norms else torch.bfloat16)
    finally:
        applied.remove()


def test_activation_offload_keeps_gradients_exact():
    torch.manual_seed(0)
    model = GPT(CFG).double()
    ids, labels = random_batch(CFG, 2)
    reference = torch.autograd.grad(model(ids, labels), list(model.parameters()))
    remove = checkpointing.install(find_blocks(model), 4, offload_activations=True,
                                   placement=resolve_device("cpu"))
    try:
        offloaded = torch.autograd.grad(model(ids, labels), list(model.parameters()))
    finally:
        remove()
    for a, b in zip(reference, offloaded):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


class KeywordBlock(nn.Module):
    """A residual MLP block whose model calls it by keyword, as Mllama calls its layers."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.down(torch.relu(self.up(hidden_states))) * attention_mask


class KeywordNet(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(KeywordBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, mask = self.embed(x), torch.ones(x.shape[0], 1, dtype=x.dtype)
        for layer in self.layers:
            h = layer(attention_mask=mask, hidden_states=h)  # the mask first: the input is found by its name
        return self.head(h).pow(2).mean()


def _held_after_forward(model: nn.Module, x: torch.Tensor, offload: bool) -> tuple[int, list[torch.Tensor]]:
    """Device bytes alive between forward and backward (the simulated ceiling's count), and the gradients."""
    remove = checkpointing.install(find_blocks(model), 4, offload_activations=offload,
                                   placement=resolve_device("cpu"))
    try:
        with SimulatedCeiling(2**40) as ceiling:
            loss = model(x)
            held = ceiling.current_bytes
            grads = list(torch.autograd.grad(loss, list(model.parameters())))
    finally:
        remove()
    return held, grads


def test_activation_offload_parks_the_input_of_blocks_called_by_keyword():
    torch.manual_seed(0)
    model = KeywordNet().double()
    x = torch.randn(64, 16, dtype=torch.float64)
    reference = torch.autograd.grad(model(x), list(model.parameters()))
    kept, _ = _held_after_forward(model, x, offload=False)
    parked, grads = _held_after_forward(model, x, offload=True)
    assert kept - parked >= 4 * x.nbytes, (kept, parked)  # each block's input on the host, not the device
    for a, b in zip(reference, grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kwargs,match", [
    ({"memory_budget": "lots"}, "memory_budget='lots'.*e.g. '24GiB'"),
    ({"memory_budget": -5}, "memory_budget must be positive"),
    ({"techniques": ("bf16", "magic")}, "techniques: unknown 'magic'"),
    ({"device": "tpu"}, "device='tpu'"),
    ({"global_batch_size": 0}, "global_batch_size must be a positive integer"),
    ({"margin": 2}, "margin must be a fraction"),
])
def test_bad_settings_name_the_setting(gpt, kwargs, match):
    model, batch = gpt
    settings = {"global_batch_size": 8, "memory_budget": "1GiB", "device": "cpu", "cache": False, **kwargs}
    with pytest.raises(autotune.InvalidSetting, match=match):
        autotune.fit(model, batch, **settings)


def test_empty_batch_and_lossless_models_are_refused(gpt):
    model, batch = gpt
    with pytest.raises(autotune.InvalidSetting, match="empty"):
        autotune.fit(model, (batch[0][:0], batch[1][:0]), memory_budget="1GiB", device="cpu", cache=False)
    with pytest.raises(autotune.InvalidSetting, match="loss_fn"):
        autotune.fit(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), torch.randn(2, 4), memory_budget="1GiB",
                     device="cpu", cache=False)


def test_a_bug_in_the_users_model_propagates_untouched():
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            raise KeyError("user bug")

    with pytest.raises(KeyError, match="user bug"):
        autotune.fit(Broken(), torch.randn(2, 4), memory_budget="1GiB", device="cpu", cache=False)


def test_budget_strings_parse():
    from autotune.sizes import parse_bytes

    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("16 GB") == 16 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5g") == int(1.5 * 2**30)
