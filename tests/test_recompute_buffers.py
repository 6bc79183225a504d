"""Recomputing a block never changes its state a second time, and the recompute computes with the state the
forward saw: a model trained with every block checkpointed equals the same model trained without checkpointing,
buffers and gradients alike, whatever module writes the buffer (spectral norm in both of torch's forms,
InstanceNorm's running statistics, a module's own EMA and counters, in place, reassigned or through `.data`).
A block whose forward writes what a recompute cannot put back (a parameter) is not recomputed, and the plan's
reason says so.

Float64 throughout, through `TrainingStep` (what `plan.apply` returns) with the same micro-batches on both sides:
each micro-batch's forward updates these buffers once, so only the split must match, not the rung.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from test_step import HUGE, make_plan, sgd
from torch import nn
from torch.nn.utils import spectral_norm as hook_spectral_norm
from torch.nn.utils.parametrizations import spectral_norm
from torch.nn.utils.parametrize import is_parametrized

import autotune
from autotune.configuration import Rung
from autotune.devices.placement import resolve_device
from autotune.search.trial import TrialRunner, Workload
from autotune.techniques import apply_rung, find_blocks, profile_blocks
from autotune.training.step import TrainingStep
from autotune.workload.optimizers import OptimizerSpec

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest.py

TOL = 1e-12
WIDTH = 8
HIDDEN = 32  # blocks hold more than their input: recomputing them frees memory


class SpectralBlock(nn.Module):
    """A residual MLP whose first layer is spectrally normalized: power iteration updates `u` and `v` in every
    training forward, and sigma (from the updated `u`) scales the weight the gradients flow through."""

    def __init__(self, hook_form: bool = False) -> None:
        super().__init__()
        wrap = hook_spectral_norm if hook_form else spectral_norm
        self.lin = wrap(nn.Linear(WIDTH, HIDDEN))
        self.out = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.lin(x)))


class InstanceBlock(nn.Module):
    """A convolution over the sequence and InstanceNorm with running statistics (updated in every training
    forward, with a version-counted `copy_`)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(WIDTH, HIDDEN, 3, padding=1)
        self.norm = nn.InstanceNorm1d(HIDDEN, affine=True, track_running_stats=True)
        self.out = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        return x + self.out(torch.tanh(self.norm(self.conv(x.transpose(1, 2)))).transpose(1, 2))


class StatefulBlock(nn.Module):
    """A block with state of its own, written every ways a module writes a buffer, and read after the write
    (so the gradients depend on it): an EMA updated in place, a counter incremented in place, a buffer
    reassigned (unless `reassign` is False), and a running total written through `.data` (no version counter
    moves)."""

    def __init__(self, reassign: bool = True) -> None:
        super().__init__()
        self.reassign = reassign
        self.lin = nn.Linear(WIDTH, HIDDEN)
        self.out = nn.Linear(HIDDEN, WIDTH)
        self.register_buffer("ema", torch.zeros(WIDTH))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("total", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * x.mean((0, 1)))
            self.steps += 1
        if self.reassign:
            self.scale = self.scale * 1.1  # a new tensor every forward
        self.total.data.add_(x.detach().square().mean())
        return x + self.out(torch.tanh(self.lin(x - self.ema))) * self.scale / (1 + self.total)


class Net(nn.Module):
    """`Net(block)`: four blocks over (B, T, WIDTH) between an input and an output projection."""

    def __init__(self, block: Callable[[], nn.Module], depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(3, WIDTH)
        self.blocks = nn.ModuleList(block() for _ in range(depth))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).squeeze(-1)


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def new(block: Callable[[], nn.Module], seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net(block).double()


def batch_of(n: int, seed: int, t: int = 6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, t, 3, generator=g, dtype=torch.float64), torch.randn(n, t, generator=g, dtype=torch.float64)


def runs(model: nn.Module) -> list[int]:
    """How many times the blocks' first layers ran (forward and recompute alike)."""
    seen = [0]
    for block in model.blocks:
        first = next(m for m in block.children())
        first.register_forward_pre_hook(lambda *_: seen.__setitem__(0, seen[0] + 1))
    return seen


def train(model: nn.Module, checkpointing: str, steps: int = 3, micro: int = 2, n: int = 6, **plan):
    """`steps` SGD steps of `model` through `TrainingStep`, `n` samples a step in micro-batches of `micro`;
    the gradients of the last step, and how many times the blocks ran. `plan`: more of the plan's fields."""
    seen = runs(model)
    optimizer, grads = stepping(model)
    made = make_plan(micro, n, checkpointing=checkpointing, budget=HUGE, offload=plan.pop("offload", "none"))
    step = TrainingStep(made.with_config(**plan) if plan else made, model, optimizer, loss_fn=mse)
    for seed in range(steps):
        step(batch_of(n, seed))
    step.close()
    return grads, seen[0]


def stepping(model: nn.Module) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """An SGD optimizer over `model`, and the list that holds the gradients it stepped with last."""
    optimizer, grads = sgd(model.parameters()), []

    def keep(*_) -> None:
        grads[:] = [p.grad.clone() for p in model.parameters()]

    optimizer.register_step_pre_hook(keep)
    return optimizer, grads


def assert_same(got: nn.Module, want: nn.Module, got_grads, want_grads) -> None:
    for (name, a), b in zip(got.named_buffers(), want.buffers()):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=lambda m, name=name: f"buffer {name}: {m}")
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        torch.testing.assert_close(p, q, rtol=TOL, atol=TOL, msg=lambda m, name=name: f"parameter {name}: {m}")
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("block", [SpectralBlock, InstanceBlock, lambda: SpectralBlock(hook_form=True)],
                         ids=["spectral_norm", "instance_norm", "hook_spectral_norm"])
def test_full_checkpointing_equals_none_with_buffers_written_in_forward(block):
    plain, recomputed = new(block), new(block)
    want_grads, plain_runs = train(plain, "none")
    got_grads, recomputed_runs = train(recomputed, "full")
    assert recomputed_runs == 2 * plain_runs  # every block was recomputed
    assert_same(recomputed, plain, got_grads, want_grads)
    if block is SpectralBlock:
        assert is_parametrized(recomputed.blocks[0].lin)


@pytest.mark.parametrize("offload", ["none", "activations"])
def test_a_modules_own_ema_counter_and_reassigned_buffers_are_written_once(offload):
    plain, recomputed = new(StatefulBlock), new(StatefulBlock)
    want_grads, plain_runs = train(plain, "none")
    got_grads, recomputed_runs = train(recomputed, "full", offload=offload)
    assert recomputed_runs == 2 * plain_runs
    assert [int(b.steps) for b in recomputed.blocks] == [9] * 4  # 3 micro-batches in each of 3 steps
    assert torch.equal(recomputed.blocks[0].scale, torch.tensor(1.1, dtype=torch.float64) ** 9)
    assert_same(recomputed, plain, got_grads, want_grads)


class SpectralStatefulBlock(StatefulBlock):
    """Every kind of state a compiled block may write: spectral norm's power iteration and the buffers above."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = spectral_norm(self.lin)


class Shared(nn.Module):
    """One block called at every depth (ALBERT's shared layer): each call writes the state the next call reads."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, WIDTH)
        self.layer = SpectralStatefulBlock()
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(3):
            h = self.layer(h)
        return self.head(h).squeeze(-1)

    @property
    def blocks(self) -> list[nn.Module]:
        return [self.layer]


@pytest.mark.parametrize("recomputed_calls", [1, 3])
def test_a_module_called_at_every_depth_has_each_calls_state_put_back(recomputed_calls):
    paths = ("layer#2", "layer#0", "layer#1")  # call i of 3, the order a profile gives
    torch.manual_seed(0)
    plain = Shared().double()
    recomputed = copy.deepcopy(plain)
    want_grads, plain_runs = train(plain, "none")
    got_grads, recomputed_runs = train(recomputed, "selective", block_paths=paths,
                                       checkpointed_blocks=recomputed_calls)
    assert recomputed_runs == plain_runs * (3 + recomputed_calls) // 3
    assert int(recomputed.layer.steps) == 27  # 3 calls in each of 3 micro-batches of 3 steps
    assert_same(recomputed, plain, got_grads, want_grads)


def train_compiled(model: nn.Module, checkpointing: str) -> list[torch.Tensor]:
    """Three SGD steps of two micro-batches each under `apply_rung` with compile on (the simulated CPU ceiling of
    `TrainingStep` runs eager); the last step's gradients."""
    optimizer, grads = stepping(model)
    applied = apply_rung(model, Rung(precision="fp32", checkpointing=checkpointing, compile=True),
                         OptimizerSpec.from_user(None, model), resolve_device("cpu"), find_blocks(model),
                         optimizer=optimizer)
    try:
        for seed in range(3):
            applied.zero_grad()
            x, y = batch_of(6, seed)
            for part in (slice(0, 3), slice(3, 6)):
                applied.backward(mse(model, (x[part], y[part])))
            applied.optimizer_step()
    finally:
        applied.remove()
    return grads


@pytest.mark.slow  # seconds: Inductor compiles
def test_a_block_compiled_inside_its_checkpoint_writes_its_state_once():
    torch._dynamo.reset()
    plain, recomputed = new(SpectralStatefulBlock), new(SpectralStatefulBlock)
    want_grads = train_compiled(plain, "none")
    got_grads = train_compiled(recomputed, "full")
    assert [int(b.steps) for b in recomputed.blocks] == [6] * 4
    assert_same(recomputed, plain, got_grads, want_grads)


def test_a_hand_made_plan_recomputes_a_block_that_writes_a_parameter_once_then_runs_it_plain(caplog):
    # Without fit's profile nothing has looked at the block before its first checkpointed forward: that
    # forward's recompute writes the weight again, with a warning, and the block is never recomputed after.
    model = new(MaxNormBlock)
    with caplog.at_level("WARNING", logger="autotune.techniques.checkpointing"):
        _, ran = train(model, "full", steps=1, micro=6)
        assert ran == 8  # the first forward recomputed (each of 4 blocks twice)
        _, ran = train(model, "full", steps=1, micro=6)
        assert ran == 4
    assert ("a recomputed block (MaxNormBlock) is not recomputed from now on: its forward writes parameter lin.weight "
            "in place, which its recompute in backward writes a second time") in caplog.text


class CountingBlock(nn.Module):
    """A block that counts its calls in a buffer its model owns, handed to it as an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, HIDDEN)
        self.out = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor, calls: torch.Tensor) -> torch.Tensor:
        calls.add_(1)
        return x + self.out(torch.tanh(self.lin(x)))


class Counted(Net):
    def __init__(self) -> None:
        super().__init__(CountingBlock)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, self.calls)
        return self.head(h).squeeze(-1)


def test_a_block_writing_a_buffer_outside_itself_is_left_out_by_the_profile_and_never_recomputed():
    torch.manual_seed(0)
    model = Counted().double()
    found = profile_blocks(model, batch_of(2, 0), mse, resolve_device("cpu"))
    assert found is not None and found.blocks == []
    assert found.refused == ["checkpointing leaves out blocks.0, blocks.1, blocks.2, blocks.3 (CountingBlock): a "
                             "recompute in backward would write a second time what the forward writes and cannot be "
                             "put back (blocks.0: its forward writes buffer calls, which is outside it)"]
    model.calls.zero_()
    _, ran = train(model, "full", steps=1, micro=6)  # a plan made by hand: the blocks found again
    assert ran == 4 and int(model.calls) == 4  # run once each, counted once each


# -- through fit ----------------------------------------------------------------------------------------------

class MaxNormBlock(nn.Module):
    """A max-norm constraint applied in forward: the weight's rows are scaled in place when over the norm, and
    decay a little every forward, so a second forward (a recompute) would change the weight again."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.weight.mul_(0.99)
        return x + torch.tanh(self.lin(x))


class Wide(nn.Module):
    """The same kinds of state in blocks wide enough that recomputing them saves memory: the plan picks it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, WIDTH)
        # (no reassigned buffer: fit's snapshot puts values back into the tensors it saw)
        self.blocks = nn.ModuleList([SpectralBlock(), InstanceBlock(), StatefulBlock(False), MaxNormBlock(),
                                     SpectralBlock(hook_form=True), InstanceBlock(), StatefulBlock(False),
                                     MaxNormBlock()])
        self.head = nn.Linear(WIDTH, 1)

    forward = Net.forward


FULL = Rung(precision="fp32", checkpointing="full")


def _peak_at_one(model: nn.Module, batch, rung: Rung) -> int:
    model = copy.deepcopy(model)
    work = Workload(model=model, batch=batch, loss_fn=mse, spec=OptimizerSpec.from_user(None, model),
                    placement=resolve_device("cpu"), budget_bytes=2**40, limit_bytes=2**40, per_rank=8,
                    blocks=find_blocks(model), measured_steps=1)
    return TrialRunner(work)(rung, 1).peak_bytes


def test_fit_checkpoints_blocks_with_state_exactly_and_leaves_out_one_it_cannot_protect():
    torch.manual_seed(0)
    model = Wide().double()
    start = copy.deepcopy(model)
    n, t = 4, 256  # long sequences: the blocks' activations dominate the peak
    batch = batch_of(n, 0, t)
    # No checkpointing fits at no micro-batch, full checkpointing does at one (fit's limit is 90% of the budget).
    budget = (_peak_at_one(start, batch, Rung(precision="fp32")) + _peak_at_one(start, batch, FULL)) / 2 / 0.9
    plan = autotune.fit(model, batch, loss_fn=mse, global_batch_size=n, memory_budget=int(budget), device="cpu",
                        cache=False, trial_steps=1, techniques=("checkpointing",))
    assert plan.checkpointing in ("selective", "full")
    assert ("checkpointing leaves out blocks.3, blocks.7 (MaxNormBlock): a recompute in backward would write a "
            "second time what the forward writes and cannot be put back (blocks.3: its forward writes parameter "
            "blocks.3.lin.weight in place)") in plan.reason
    assert sorted(plan.block_paths) == [f"blocks.{i}" for i in (0, 1, 2, 4, 5, 6)]
    for a, b in zip([*model.parameters(), *model.buffers()], [*start.parameters(), *start.buffers()]):
        assert torch.equal(a, b)  # the trials' writes were put back

    # Training with the plan equals training without checkpointing on the same micro-batches.
    want = copy.deepcopy(start)
    optimizer, want_grads = stepping(want)
    reference = TrainingStep(make_plan(plan.micro_batch_size, n, budget=HUGE), want, optimizer, loss_fn=mse)
    optimizer, got_grads = stepping(model)
    step = plan.apply(model, optimizer, loss_fn=mse)
    for seed in range(2):
        reference(batch_of(n, seed, t))
        step(batch_of(n, seed, t))
    reference.close()
    step.close()
    assert_same(model, want, got_grads, want_grads)
