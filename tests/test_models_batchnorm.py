"""Models with batch statistics: BatchNorm cannot train on one sample where a channel holds a
single value (BatchNorm1d on (N, C), a ResNet whose last stage is 1x1 on 32x32 images), and an attempt at a step
that ran out of memory must leave no running statistics behind.

- The search never keeps micro-batch 1 for such a model: the failure there moves its start to 2, the plan
  says so, and no micro-batch of the plan (the last included) holds 1 sample: the split is balanced.
- A recovered step equals a clean one at the new micro-batch: parameters, running statistics and
  `num_batches_tracked` alike.
- Recovery climbs only within the techniques `fit` was given.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from test_step import HUGE, Net, make_plan, seq_batch, sgd
from torch import nn
from torch.nn import functional as F

import autotune
from autotune.configuration import Rung
from autotune.errors import InvalidSetting, NoFeasiblePlan, TooFewSamples
from autotune.evidence import Trial
from autotune.plan import Plan
from autotune.search.controller import Controller
from autotune.training.step import TrainingStep

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest.py

TOL = 1e-10


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def regression(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return ((model(x).squeeze(-1) - y) ** 2).mean()


def xy(n: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g, dtype=dtype), torch.randn(n, generator=g, dtype=dtype)


def sizes_seen(model: nn.Module) -> list[int]:
    """Record the number of samples of every forward of `model` from now on."""
    seen: list[int] = []
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    return seen


# -- the search and the plan ------------------------------------------------------------------------------

def test_an_mlp_with_batchnorm1d_tunes_from_micro_batch_2_and_never_trains_on_one_sample():
    model = mlp()
    plan = autotune.fit(model, xy(8), loss_fn=regression, global_batch_size=9, device="cpu",
                        memory_budget="40MiB", cache=False)
    assert plan.min_micro_batch_size == 2
    assert "micro-batch 1 skipped: ValueError: Expected more than 1 value per channel" in plan.reason
    assert "balanced" in plan.reason
    assert all(t.micro_batch_size >= 2 for t in plan.trials)  # 9 is odd: at 2 a 1 would be left, so 3 up
    assert min(t.micro_batch_size for t in plan.trials) == 3
    assert plan.last_micro_batch_size >= 2

    seen = sizes_seen(model)
    step = plan.apply(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=regression)
    for seed in range(2):
        assert math.isfinite(step(xy(9, seed=seed)))
    # The same plan at micro-batch 4: 4 + 4 + 1 would leave one sample alone; balanced it is 3 + 3 + 3.
    step.plan = plan.with_config(micro_batch_size=4, accumulation_steps=3, last_micro_batch_size=3)
    step(xy(9, seed=2))
    step(xy(7, seed=3))  # a smaller batch than the plan's at micro-batch 4: 3 + 4 (the odd one out first)
    step.close()
    assert min(seen) >= 2 and seen[-5:] == [3, 3, 3, 3, 4]


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus a (strided 1x1) shortcut, as in torchvision's ResNet."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + self.short(x))


class TinyResNet(nn.Module):
    """32x32 -> 16 (stem) -> 8 -> 4 -> 2 -> 1: the last stage's maps are 1x1, so at one sample each of its
    BatchNorm channels holds a single value."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layers = nn.Sequential(BasicBlock(8, 8, 2), BasicBlock(8, 16, 2), BasicBlock(16, 16, 2),
                                    BasicBlock(16, 16, 2))
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).flatten(1))


def classification(model: nn.Module, batch) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


@pytest.mark.slow
def test_a_resnet_whose_last_stage_is_1x1_tunes_and_trains():
    torch.manual_seed(0)
    model = TinyResNet()
    g = torch.Generator().manual_seed(0)
    batch = torch.randn(6, 3, 32, 32, generator=g), torch.randint(0, 10, (6,), generator=g)
    start = copy.deepcopy(model)
    plan = autotune.fit(model, batch, loss_fn=classification, device="cpu", memory_budget="64MiB", cache=False,
                        trial_steps=1)
    assert plan.min_micro_batch_size == 2 and "micro-batch 1 skipped" in plan.reason
    for a, b in zip([*model.parameters(), *model.buffers()], [*start.parameters(), *start.buffers()]):
        assert torch.equal(a, b)  # the trials' statistics were put back too
    seen = sizes_seen(model)
    step = plan.apply(model, torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=classification)
    losses = [step(batch) for _ in range(2)]
    step.close()
    assert all(math.isfinite(x) for x in losses) and min(seen) >= 2
    assert int(model.layers[3].bn2.num_batches_tracked) >= 2


def test_a_hand_made_plan_that_leaves_one_sample_is_rebalanced_without_a_trace():
    # A plan made before the model was seen (or by hand) splits 9 as 4 + 4 + 1: the 1-sample micro-batch
    # fails on batch statistics; the batch is re-run balanced (3 + 3 + 3) as if that had been the plan.
    model = mlp().double()
    batch = xy(9, seed=4, dtype=torch.float64)
    got = copy.deepcopy(model)
    step = TrainingStep(make_plan(4, 9), got, sgd(got.parameters()), loss_fn=regression)
    step(batch)
    assert step.plan.min_micro_batch_size == 2 and "batch statistics" in step.plan.reason
    assert [(f.kind, f.figures) for f in step.plan.findings] == [("balanced", {"micro_batch_size": 4})]
    assert (step.plan.accumulation_steps, step.plan.last_micro_batch_size) == (3, 3)
    assert not step.recoveries  # not an out-of-memory: nothing recorded as one
    want = copy.deepcopy(model)
    balanced = make_plan(4, 9).with_config(accumulation_steps=3, last_micro_batch_size=3,
                                   min_micro_batch_size=2)
    TrainingStep(balanced, want, sgd(want.parameters()), loss_fn=regression)(batch)
    assert_same_state(got, want)


# -- recovery leaves no trace -----------------------------------------------------------------------------

class NormBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.norm = nn.BatchNorm1d(4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, C); BatchNorm1d wants (B, C, T)
        h = self.norm(self.up(x).transpose(1, 2)).transpose(1, 2)
        return x + self.down(torch.tanh(h))


class NormNet(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(3, width)
        self.blocks = nn.ModuleList(NormBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).squeeze(-1)


def padded_loss(model: NormNet, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Trimmed to the micro-batch's longest sequence (dynamic padding): long sequences need more memory."""
    x, y, lengths = batch
    t = max(int(lengths.max()), 1)
    mask = torch.arange(t) < lengths[:, None]
    err = (model(x[:, :t]) - y[:, :t]) ** 2
    return (err * mask).sum(), mask.sum()


def padded(lengths: list[int], t: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    return (torch.randn(n, t, 3, generator=g, dtype=torch.float64), torch.randn(n, t, generator=g, dtype=torch.float64),
            torch.tensor(lengths))


def run(plan: Plan, model: nn.Module, batches) -> tuple[nn.Module, TrainingStep]:
    m = copy.deepcopy(model)
    step = TrainingStep(plan, m, sgd(m.parameters()), loss_fn=padded_loss)
    for b in batches:
        step(b)
    return m, step


def assert_same_state(got: nn.Module, want: nn.Module) -> None:
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        assert (p - q).norm() <= TOL * q.norm(), f"{name}: parameters differ"
    for (name, b), c in zip(got.named_buffers(), want.buffers()):
        assert torch.equal(b, c), f"{name}: {b.flatten()[:4].tolist()} != {c.flatten()[:4].tolist()}"


def test_running_statistics_after_a_recovered_step_equal_a_clean_steps():
    torch.manual_seed(0)
    model = NormNet().double()
    # The second micro-batch of 4 holds sequences 8x longer than the first: it runs out of memory after the
    # first micro-batch went through BatchNorm (statistics folded in, num_batches_tracked counted).
    batch = padded([8, 5, 8, 3, 64, 40, 64, 7])
    peak = {micro: run(make_plan(micro, 8), model, [batch])[1].last_peak_bytes for micro in (2, 4)}
    budget = (peak[2] + peak[4]) // 2
    got, step = run(make_plan(4, 8, budget=budget), model, [batch, padded([8, 5, 8, 3, 6, 4, 8, 7], seed=1)])
    assert [(r.failed, r.micro_step, r.now) for r in step.recoveries] == [
        ("fp32 at micro-batch 4", 1, "fp32 at micro-batch 2")]
    want, _ = run(make_plan(2, 8, budget=HUGE), model, [batch, padded([8, 5, 8, 3, 6, 4, 8, 7], seed=1)])
    assert_same_state(got, want)
    assert int(got.blocks[0].norm.num_batches_tracked) == 8  # 4 micro-batches in each of 2 steps


def test_a_buffer_a_module_updates_itself_is_put_back_too():
    # Not a norm layer: a running count a module keeps with add_. Learned from the first clean step.
    class Counting(NormNet):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros((), dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training:
                self.seen.add_(x.shape[0])
            return super().forward(x)

    torch.manual_seed(0)
    model = Counting().double()
    batch = padded([8, 5, 8, 3, 64, 40, 64, 7])
    short = padded([8, 5, 8, 3, 6, 4, 8, 7], seed=1)
    peak = {micro: run(make_plan(micro, 8), model, [batch])[1].last_peak_bytes for micro in (2, 4)}
    got, step = run(make_plan(4, 8, budget=(peak[2] + peak[4]) // 2), model, [short, batch])
    assert len(step.recoveries) == 1
    assert float(got.seen) == 16.0  # 8 samples a step, the failed attempt's 4 not counted


def test_recovery_stays_within_the_techniques_fit_was_given():
    torch.manual_seed(0)
    model = Net().double()
    long = seq_batch(4, 96, seed=3)
    bf16 = dict(precision="bf16")
    plain = run_peak(make_plan(1, 4, **bf16), model, long)
    full = run_peak(make_plan(1, 4, checkpointing="full", **bf16), model, long)
    assert full < plain  # the premise: with checkpointing the long batch would fit at micro-batch 1
    budget = (plain + full) // 2
    plan = autotune.fit(model, seq_batch(4, 4, seed=2), global_batch_size=4, memory_budget=budget, device="cpu",
                        cache=False, techniques=("bf16",))
    assert plan.techniques == ("bf16",) and plan.rung.name == "bf16"
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).techniques == ("bf16",)  # as the cache keeps it
    m = copy.deepcopy(model)
    step = plan.apply(m, sgd(m.parameters()))
    with pytest.raises(NoFeasiblePlan, match="no higher rung is allowed") as info:
        step(long)
    assert {t.rung.name for t in info.value.trials} == {"bf16"}  # never checkpointing, never offload


def run_peak(plan: Plan, model: nn.Module, batch) -> int:
    m = copy.deepcopy(model)
    step = TrainingStep(plan, m, sgd(m.parameters()))
    step(batch)
    return step.last_peak_bytes


# -- the search's floor, against a scripted runner ----------------------------------------------------------

class NeedsTwo:
    """A fake device whose model cannot train on one sample: micro-batch 1 raises as the trial runner does."""

    def __init__(self, budget_samples: int) -> None:
        self.budget_samples, self.calls = budget_samples, []

    def __call__(self, rung: Rung, micro: int) -> Trial:
        self.calls.append(micro)
        if micro == 1:
            raise TooFewSamples("ValueError: Expected more than 1 value per channel when training")
        if micro > self.budget_samples:
            return Trial(rung=rung, micro_batch_size=micro, outcome="oom", peak_bytes=100)
        return Trial(rung=rung, micro_batch_size=micro, outcome="ok", peak_bytes=10 + micro, step_seconds=0.01 * micro,
                     optimizer_seconds=0.01, samples_per_second=100.0 * micro / (micro + 1))


@pytest.mark.parametrize("per_rank,floor", [(8, 2), (9, 3)], ids=["even", "odd"])
def test_the_search_starts_again_at_the_smallest_split_without_a_single_sample(per_rank, floor):
    device = NeedsTwo(budget_samples=1)  # nothing above 1 fits either: the floor is all that is tried
    with pytest.raises(NoFeasiblePlan, match=f"micro-batch 1 skipped.*starts at {floor}"):
        Controller(device, per_rank=per_rank, limit_bytes=50).search([Rung()])
    assert device.calls == [1, floor]
    device = NeedsTwo(budget_samples=4)
    result = Controller(device, per_rank=per_rank, limit_bytes=50).search([Rung()])
    assert result.smallest == 2 and min(t.micro_batch_size for t in result.trials) == floor
    assert 1 not in [t.micro_batch_size for t in result.trials]


def test_a_per_rank_batch_of_one_cannot_serve_such_a_model():
    with pytest.raises(InvalidSetting, match="raise global_batch_size to 2 or more samples per rank"):
        Controller(NeedsTwo(budget_samples=4), per_rank=1, limit_bytes=50).search([Rung()])


def test_recovery_halves_no_lower_than_two_then_climbs_a_rung():
    torch.manual_seed(0)
    model = NormNet().double()
    batch = padded([64] * 8)
    need_two = make_plan(4, 8).with_config(min_micro_batch_size=2)
    plain = run(need_two.with_config(micro_batch_size=2, accumulation_steps=4, last_micro_batch_size=2),
                model, [batch])[1].last_peak_bytes
    full = run(need_two.with_config(micro_batch_size=2, accumulation_steps=4, last_micro_batch_size=2,
                                   checkpointing="full"), model, [batch])[1].last_peak_bytes
    assert full < plain  # the premise: at 2, only recomputing the blocks fits
    got, step = run(need_two.with_config(memory_budget_bytes=(plain + full) // 2), model, [batch])
    assert [r.now for r in step.recoveries] == ["fp32 at micro-batch 2", "fp32+full ckpt at micro-batch 2"]
    assert step.plan.min_micro_batch_size == 2


def test_dropout_after_a_recovery_draws_what_a_clean_step_draws():
    # The failed attempt consumed random numbers; the re-run draws from where it started, as a clean step would.
    class Dropping(NormNet):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.dropout(super().forward(x), p=0.5, training=self.training)

    torch.manual_seed(0)
    model = Dropping().double()
    batch = padded([8, 5, 8, 3, 64, 40, 64, 7])
    peak = {micro: run(make_plan(micro, 8), model, [batch])[1].last_peak_bytes for micro in (2, 4)}
    torch.manual_seed(1)
    got, step = run(make_plan(4, 8, budget=(peak[2] + peak[4]) // 2), model, [batch])
    assert len(step.recoveries) == 1
    torch.manual_seed(1)
    want, _ = run(make_plan(2, 8), model, [batch])
    assert_same_state(got, want)
