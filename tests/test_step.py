"""`plan.apply()` / `TrainingStep` on the CPU: exact accumulation, and recovery from OOM under the simulated ceiling.

Exactness is checked in float64 against one full-batch step of the same optimizer on a copy of the model.
SGD is the main yardstick: its update is proportional to the gradient, so a mis-weighted micro-batch shows
(Adam's first step is lr x sign(g) and would hide it). The updates are compared as well as the parameters,
because a parameter is ~1 and its update ~1e-2: a relative error of 1e-10 on the parameter alone would let
an update error of 1e-8 through.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

import autotune
from autotune.cache.store import PlanCache
from autotune.errors import NoFeasiblePlan
from autotune.plan import Plan
from autotune.techniques.offload import HostOptimizer
from autotune.training.step import TrainingStep
from autotune.workload.batching import solve_accumulation

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest.py

TOL = 1e-10
HUGE = 2**40  # a budget nothing reaches: the ceiling is on, but never hit


# -- a tiny sequence model: memory grows with batch x length, like a transformer's activations ----------

class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    """`model(x, y)`: mean squared error over every position of every sample; x (B, T, 3), y (B, T)."""

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(3, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).squeeze(-1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.predict(x) - y) ** 2).mean()


def token_loss(model: Net, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared error summed over the real (unpadded) positions, and their count: `(loss_sum, count)`.

    Like dynamic padding, the micro-batch is trimmed to its longest sequence, so a micro-batch holding a
    long sequence needs more memory than one of short ones.
    """
    x, y, lengths = batch
    t = max(int(lengths.max()), 1)
    mask = torch.arange(t) < lengths[:, None]  # (B, T)
    err = (model.predict(x[:, :t]) - y[:, :t]) ** 2
    return (err * mask).sum(), mask.sum()


def full_batch_loss(loss_fn, model, batch) -> torch.Tensor:
    out = loss_fn(model, batch) if loss_fn is not None else model(*batch)
    if isinstance(out, tuple):
        return out[0] / out[1]
    return out


def make_plan(micro: int, n: int, *, precision: str = "fp32", checkpointing: str = "none", offload: str = "none",
              budget: int = HUGE, key: str = "") -> Plan:
    steps, last = solve_accumulation(n, micro)
    return Plan.of(precision=precision, checkpointing=checkpointing, offload=offload, micro_batch_size=micro,
                accumulation_steps=steps, world_size=1, global_batch_size=n, last_micro_batch_size=last,
                peak_memory_bytes=0, memory_budget_bytes=budget, margin=0.1, samples_per_second=0.0,
                device="cpu", key=key)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def seq_batch(n: int, t: int, seed: int = 0, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, t, 3, generator=g, dtype=dtype), torch.randn(n, t, generator=g, dtype=dtype)


def new_model(seed: int = 0, dtype=torch.float64) -> Net:
    torch.manual_seed(seed)
    return Net().to(dtype)


def run_plan(plan: Plan, model: Net, batches, make_opt=sgd, loss_fn=None, **kwargs):
    """Train a copy of `model` with `plan` over `batches`; the trained copy, the step and the losses."""
    m = copy.deepcopy(model)
    step = TrainingStep(plan, m, make_opt(m.parameters()), loss_fn=loss_fn, **kwargs)
    losses = [step(b) for b in batches]
    return m, step, losses


def run_reference(model: Net, batches, make_opt=sgd, loss_fn=None):
    """The same steps, each a single full-batch step with no plan and no ceiling."""
    m = copy.deepcopy(model)
    opt = make_opt(m.parameters())
    losses = []
    for b in batches:
        loss = full_batch_loss(loss_fn, m, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return m, losses


def assert_same_training(start: Net, got: Net, want: Net) -> None:
    """Parameters and updates agree to TOL (relative, per tensor)."""
    for (name, p0), p, q in zip(start.named_parameters(), got.parameters(), want.parameters()):
        assert p.dtype == q.dtype, name
        assert (p - q).norm() <= TOL * q.norm(), f"{name}: parameters differ"
        assert ((p - p0) - (q - p0)).norm() <= TOL * (q - p0).norm(), f"{name}: updates differ"


def peak_of(plan: Plan, model: Net, batch, make_opt=sgd, loss_fn=None) -> int:
    """Peak simulated memory of one step of `plan` with no budget in force."""
    _, step, _ = run_plan(plan, model, [batch], make_opt, loss_fn)
    assert step.last_peak_bytes is not None
    return step.last_peak_bytes


# -- exact accumulation -------------------------------------------------------------------------------------

@pytest.mark.parametrize("micro,n", [(4, 8), (3, 8), (8, 8), (1, 5), (4, 7)],
                         ids=["even", "uneven", "whole", "ones", "uneven-odd"])
def test_one_step_equals_a_full_batch_step(micro, n):
    model = new_model()
    batches = [seq_batch(n, 6, seed=1)]
    got, step, losses = run_plan(make_plan(micro, n), model, batches)
    want, want_losses = run_reference(model, batches)
    assert_same_training(model, got, want)
    assert math.isclose(losses[0], want_losses[0], rel_tol=TOL)
    assert step.plan.micro_batch_size == micro and not step.recoveries


def test_adamw_over_several_steps_equals_full_batch_steps():
    model = new_model()
    batches = [seq_batch(7, 6, seed=s) for s in range(3)]
    got, _, losses = run_plan(make_plan(3, 7), model, batches, make_opt=adamw)
    want, want_losses = run_reference(model, batches, make_opt=adamw)
    assert_same_training(model, got, want)
    assert losses == pytest.approx(want_losses, rel=TOL)


def padded_batch(lengths: list[int], t: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = seq_batch(len(lengths), t, seed=seed)
    return x, y, torch.tensor(lengths)


@pytest.mark.parametrize("micro", [2, 3, 8])
def test_token_weighted_loss_with_padding_equals_full_batch_step(micro):
    # Micro-batches hold very different token counts (the first holds none at micro 2): a per-micro-batch
    # mean would weight the short sequences' tokens too much.
    model = new_model()
    batch = padded_batch([0, 0, 1, 9, 2, 12, 3, 5], t=12)
    got, _, losses = run_plan(make_plan(micro, 8), model, [batch], loss_fn=token_loss)
    want, want_losses = run_reference(model, [batch], loss_fn=token_loss)
    assert_same_training(model, got, want)
    assert math.isclose(losses[0], want_losses[0], rel_tol=TOL)


def test_loss_weights_keep_counts_known_on_the_host_there():
    # A count put on the device is a copy from pageable memory that waits for the device's queue: two per
    # micro-batch drained it on an H100 (benchmarks/profile_step.py). A loss on the meta device stands in
    # for a device: counts that came from the host must stay there, and the arithmetic must still work.
    from autotune.workload.accumulation import LossWeights

    for divided in (True, False):
        weights = LossWeights(8, 2, total=100.0)
        for count in (40.0, 60.0):
            loss = torch.ones((), device="meta", requires_grad=True)
            out = (weights.weigh_divided(loss, count) if divided
                   else weights.weigh(loss, count, 4, expected=count, mean=True))
            assert out.device.type == "meta"
        assert weights.count_total.device.type == "cpu" and weights.estimate.device.type == "cpu"
        assert float(weights.count_total) == 100.0 and not weights.needs_correction()
        assert weights.mean_loss().device.type == "meta"


def test_a_share_known_up_front_is_exactly_the_share_the_summed_totals_give():
    # Replicated ranks skip reading the summed totals before the last backward where `share_known` (the read
    # waits for the device): there the totals' share must be exactly 1. Here one rank's totals are the global
    # ones, so `share` computes what the ranks would; counts from a user's loss are not known up front.
    from autotune.workload.accumulation import LossWeights

    def weights(kind: str, summed: bool = True) -> LossWeights:
        w = LossWeights(8, 2, divisor=8.0, total=100.0, summed=summed)
        for count, size in ((37.0, 5), (63.0, 3)):
            loss = torch.tensor(2.0, dtype=torch.float64)
            if kind == "divided":
                w.weigh_divided(loss, count)
            elif kind == "labels":
                w.weigh(loss, count, size, expected=count, mean=True, labelled=True)
            elif kind == "user-counts":
                w.weigh(loss, count + 1.0, size, expected=count)  # the loss counts tokens its own way
            else:
                w.weigh(loss, None, size)
        return w

    for kind in ("divided", "labels", "mean"):
        w = weights(kind)
        assert w.share_known() and w.share(w.totals(torch.device("cpu"))) == 1.0, kind
        assert not weights(kind, summed=False).share_known()  # one process: no global counts were summed
    w = weights("user-counts")
    assert not w.share_known() and w.share(w.totals(torch.device("cpu"))) != 1.0


def test_dict_batch_and_checkpointing_rungs_stay_exact():
    model = new_model()
    x, y = seq_batch(6, 5, seed=3)
    batch = {"x": x, "y": y}
    for checkpointing, offload in [("selective", "none"), ("full", "none"), ("full", "activations")]:
        plan = make_plan(4, 6, checkpointing=checkpointing, offload=offload)
        got, _, _ = run_plan(plan, model, [batch])
        want, _ = run_reference(model, [(x, y)])
        assert_same_training(model, got, want)


def test_bf16_plan_trains_close_to_fp32():
    model = new_model(dtype=torch.float32)
    batches = [seq_batch(8, 6, seed=s, dtype=torch.float32) for s in range(3)]
    got, step, losses = run_plan(make_plan(3, 8, precision="bf16"), model, batches)
    want, want_losses = run_reference(model, batches)
    assert all(math.isfinite(v) for v in losses)
    assert losses == pytest.approx(want_losses, rel=2e-2)
    for p, q, p0 in zip(got.parameters(), want.parameters(), model.parameters()):
        assert p.dtype == torch.float32
        assert not torch.equal(p, p0)
        assert (p - q).norm() <= 0.05 * (q - p0).norm() + 1e-6


def test_returned_loss_is_the_mean_over_samples():
    model = new_model()
    batch = seq_batch(5, 4, seed=4)
    with torch.no_grad():
        per_sample = torch.stack([model(batch[0][i:i + 1], batch[1][i:i + 1]) for i in range(5)])
    _, _, losses = run_plan(make_plan(2, 5), model, [batch])
    assert math.isclose(losses[0], float(per_sample.mean()), rel_tol=TOL)


# -- optimizer offload and the user's optimizer --------------------------------------------------------------

def test_optimizer_offload_keeps_the_users_optimizer_consistent():
    model = new_model(dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = TrainingStep(make_plan(4, 8, precision="bf16", checkpointing="full", offload="optimizer"), model, opt)
    batches = [seq_batch(8, 6, seed=s, dtype=torch.float32) for s in range(2)]
    for b in batches:
        assert math.isfinite(step(b))
    assert isinstance(step.optimizer, HostOptimizer)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # 16-bit on the device
    # Nothing stale in the user's optimizer: its state is the host optimizer's own (no device copy).
    host_state = [step.optimizer.shares.optimizer.state[m] for m in step.optimizer.shares.masters]
    assert len(opt.state) == len(host_state) and all(any(s is h for h in host_state) for s in opt.state.values())
    with pytest.raises(RuntimeError, match="offload"):
        opt.step()
    saved = opt.state_dict()  # the live host state, in the user's optimizer's own indexing
    n_params = len(list(model.parameters()))
    assert sorted(saved["state"]) == list(range(n_params))
    assert all(float(s["step"]) == 2 for s in saved["state"].values())

    # An LR scheduler writes to the user's optimizer: the host optimizer follows.
    for group in opt.param_groups:
        group["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    step(batches[0])
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))

    step.close()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert len(opt.state) == n_params
    assert all(float(s["step"]) == 3 for s in opt.state.values())
    opt.step()  # the user's optimizer works again, with the state the host built


def test_optimizer_offload_load_state_dict_goes_to_the_host():
    model = new_model(dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = TrainingStep(make_plan(4, 8, precision="bf16", offload="optimizer"), model, opt)
    step(seq_batch(8, 6, dtype=torch.float32))
    checkpoint = copy.deepcopy(opt.state_dict())
    step(seq_batch(8, 6, seed=1, dtype=torch.float32))
    opt.load_state_dict(checkpoint)  # resume from the checkpoint taken after one step
    host_state = [step.optimizer.shares.optimizer.state[m] for m in step.optimizer.shares.masters]
    assert all(any(s is h for h in host_state) for s in opt.state.values())  # the host's, loaded
    assert all(float(s["step"]) == 1 for s in opt.state_dict()["state"].values())


def test_fp16_with_optimizer_offload_scales_and_unscales_once():
    # Regression: AppliedRung.backward skipped the loss scale under optimizer offload while HostOptimizer
    # still unscaled (GradScaler asserted "_scale is None" at the first step).
    model = new_model(dtype=torch.float32)
    batch = seq_batch(8, 6, dtype=torch.float32)
    plain = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731 - the update is proportional to the gradient
    want, _ = run_reference(model, [batch], make_opt=plain)
    got, step, _ = run_plan(make_plan(4, 8, precision="fp16", offload="optimizer"), model, [batch], make_opt=plain)
    step.close()
    for p, q, p0 in zip(got.parameters(), want.parameters(), model.parameters()):
        assert (p - q).norm() <= 0.02 * (q - p0).norm() + 1e-4


# -- recovery from OOM under the simulated ceiling ---------------------------------------------------------

def test_oom_in_the_middle_of_a_batch_recovers_exactly():
    # Plan at micro-batch 4; the second micro-batch holds sequences 8x longer than the first (dynamic
    # padding), so it runs out of memory after the first one has accumulated gradients.
    model = new_model()
    batch = padded_batch([8, 5, 8, 3, 64, 40, 64, 7], t=64)
    budget = (peak_of(make_plan(4, 8), model, batch, loss_fn=token_loss)
              + peak_of(make_plan(2, 8), model, batch, loss_fn=token_loss)) // 2
    short = padded_batch([8, 5, 8, 3, 6, 4, 8, 7], t=64)
    assert peak_of(make_plan(4, 8), model, short, loss_fn=token_loss) < budget  # the plan fits what it was made for

    plan = make_plan(4, 8, budget=budget, key="test-key")
    got, step, losses = run_plan(plan, model, [batch], loss_fn=token_loss)
    want, want_losses = run_reference(model, [batch], loss_fn=token_loss)
    assert [(r.failed, r.micro_step, r.now) for r in step.recoveries] == [
        ("fp32 at micro-batch 4", 1, "fp32 at micro-batch 2")]
    assert (step.plan.micro_batch_size, step.plan.accumulation_steps) == (2, 4)
    assert step.plan.key == "test-key" and step.plan.reason == \
        "recovered from an OOM in training at micro-batch 4: halved to 2"  # the one test of this wording
    (found,) = step.plan.findings
    assert (found.kind, found.place, found.figures) == (
        "recovered", "instead", {"failed_micro_batch_size": 4, "micro_batch_size": 2})
    assert_same_training(model, got, want)  # no sample lost, none counted twice
    assert math.isclose(losses[0], want_losses[0], rel_tol=TOL)


def test_longer_inputs_than_fit_saw_recover_with_the_same_result():
    model = new_model()
    example = seq_batch(8, 8, seed=5)
    plan = autotune.fit(model, example, global_batch_size=8, optimizer=sgd(model.parameters()),
                        memory_budget=200_000, device="cpu", cache=False, techniques=("checkpointing",))
    longer = [seq_batch(8, 64, seed=6), seq_batch(8, 64, seed=7)]
    got, step, losses = run_plan(plan, model, longer)
    want, want_losses = run_reference(model, longer)
    assert step.recoveries, f"no OOM at 8x the tuned length with {plan.summary()}"
    assert step.recoveries[0].step == 0  # (a second one may follow: momentum buffers appear at step 1)
    assert (step.plan.micro_batch_size, step.plan.rung) != (plan.micro_batch_size, plan.rung)
    assert_same_training(model, got, want)
    assert losses == pytest.approx(want_losses, rel=TOL)


def test_a_rung_is_added_when_micro_batch_1_does_not_fit():
    model = new_model()
    batch = seq_batch(4, 64, seed=8)
    plain = peak_of(make_plan(1, 4), model, batch)
    full = peak_of(make_plan(1, 4, checkpointing="full"), model, batch)
    assert full < plain
    got, step, _ = run_plan(make_plan(2, 4, budget=(plain + full) // 2, key="k"), model, [batch])
    want, _ = run_reference(model, [batch])
    failed = [r.failed for r in step.recoveries]
    assert failed[:2] == ["fp32 at micro-batch 2", "fp32 at micro-batch 1"]
    assert step.plan.checkpointing in ("selective", "full") and step.plan.micro_batch_size == 1
    assert step.plan.precision == "fp32"  # recovery never changes the numerics
    assert_same_training(model, got, want)


def test_no_feasible_plan_past_the_top_rung():
    model = new_model()
    batch = seq_batch(4, 64, seed=9)
    # The float64 model keeps its weights' dtype under optimizer offload, so its fp32 ladder ends there.
    top = min(peak_of(make_plan(1, 4, checkpointing="full", offload=offload), model, batch)
              for offload in ("activations", "optimizer"))
    m = copy.deepcopy(model)
    step = TrainingStep(make_plan(2, 4, budget=int(0.9 * top)), m, sgd(m.parameters()))
    shapes = r"\[\[0\] \(1, 64, 3\); \[1\] \(1, 64\)\]"
    top_rung = r"fp32\+full ckpt\+optimizer offload at micro-batch 1"
    with pytest.raises(NoFeasiblePlan, match=rf"{shapes} does not fit .* {top_rung}") as info:
        step(batch)
    tried = [(t.rung.name, t.micro_batch_size) for t in info.value.trials]
    assert tried[:2] == [("fp32", 2), ("fp32", 1)] and tried[-1] == ("fp32+full ckpt+optimizer offload", 1)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), model.parameters()))  # no partial update


def test_recovery_climbs_only_the_allowed_techniques():
    model = new_model()
    batch = seq_batch(4, 64, seed=8)
    plain = peak_of(make_plan(1, 4), model, batch)
    m = copy.deepcopy(model)
    step = TrainingStep(make_plan(2, 4, budget=int(0.9 * plain)), m, sgd(m.parameters()), techniques=("bf16",))
    with pytest.raises(NoFeasiblePlan, match="no higher rung is allowed"):
        step(batch)


def test_micro_batch_grows_back_after_clean_steps():
    model = new_model()
    long, short = seq_batch(8, 64, seed=10), seq_batch(8, 8, seed=11)
    budget = (peak_of(make_plan(4, 8), model, long) + peak_of(make_plan(2, 8), model, long)) // 2
    _, step, _ = run_plan(make_plan(4, 8, budget=budget), model, [long, short, short, short], grow_after=2)
    assert step.recoveries and step.recoveries[0].now.endswith("micro-batch 2")
    assert step.plan.micro_batch_size == 4
    assert (step.plan.findings[-1].kind, step.plan.findings[-1].figures) == (
        "grown", {"micro_batch_size": 4, "clean_steps": 2})
    step(long)  # the probe's size fails again on a long batch: halved again, and the next probe waits longer
    assert step.plan.micro_batch_size == 2 and step._grow_wait == 4


def test_errors_that_are_not_oom_propagate_untouched():
    model = new_model()

    def broken(model, batch):
        raise ValueError("bad batch")

    step = TrainingStep(make_plan(2, 4), model, sgd(model.parameters()), loss_fn=broken)
    with pytest.raises(ValueError, match="bad batch"):
        step(seq_batch(4, 4))
    assert not step.recoveries and step.plan.micro_batch_size == 2


def test_plan_apply_returns_a_training_step():
    model = new_model()
    step = make_plan(2, 4).apply(model, sgd(model.parameters()))
    assert isinstance(step, TrainingStep)
    assert math.isfinite(step(seq_batch(4, 4)))


def test_recovery_into_optimizer_offload_carries_the_optimizer_state():
    # Wide and shallow: weights and AdamW state are a large share of memory, so the optimizer-offload
    # rung (16-bit weights on the device, state on the host) fits a long batch the rung below does not.
    torch.manual_seed(0)
    model = Net(width=48, depth=2).float()
    short, long = seq_batch(2, 2, seed=1, dtype=torch.float32), seq_batch(2, 800, seed=2, dtype=torch.float32)

    def second_step_peak(plan):
        m = copy.deepcopy(model)
        step = TrainingStep(plan, m, adamw(m.parameters()))
        step(short)  # the AdamW state appears at the first step
        step(long)
        return step.last_peak_bytes

    below = second_step_peak(make_plan(1, 2, precision="bf16", checkpointing="full", offload="activations"))
    top = second_step_peak(make_plan(1, 2, precision="bf16", checkpointing="full", offload="optimizer"))
    assert top < below
    plan = make_plan(2, 2, precision="bf16", checkpointing="full", offload="activations", budget=(top + below) // 2)
    m = copy.deepcopy(model)
    opt = adamw(m.parameters())
    step = TrainingStep(plan, m, opt)
    step(short)
    assert math.isfinite(step(long))
    assert step.plan.offload == "optimizer" and step.plan.micro_batch_size == 1
    assert [r.micro_step for r in step.recoveries] == [0, 0]
    host_state = [step.optimizer.shares.optimizer.state[m] for m in step.optimizer.shares.masters]
    assert all(any(s is h for h in host_state) for s in opt.state.values())  # the host's, not a stale copy
    # One AdamW step per batch: the failed attempts never reached the optimizer, and its state moved on.
    assert all(float(s["step"]) == 2 for s in opt.state_dict()["state"].values())
    step.close()
    assert all(float(s["step"]) == 2 for s in opt.state.values())


# -- the plan cache ------------------------------------------------------------------------------------------

def fit_and_train_longer(model: Net, **fit_args):
    example = seq_batch(8, 8, seed=5)
    plan = autotune.fit(model, example, global_batch_size=8, optimizer=sgd(model.parameters()),
                        memory_budget=200_000, device="cpu", techniques=("checkpointing",), **fit_args)
    _, step, _ = run_plan(plan, model, [seq_batch(8, 64, seed=6)])
    return plan, step


def test_a_recovery_is_written_to_the_plan_cache(tmp_path):
    model = new_model()
    plan, step = fit_and_train_longer(model)  # the default cache: $AUTOTUNE_CACHE, in tmp_path
    assert plan.key and step.recoveries
    cached = PlanCache(tmp_path / "plans.db").get(plan.key)
    assert cached is not None
    assert (cached.micro_batch_size, cached.rung) == (step.plan.micro_batch_size, step.plan.rung)
    again = autotune.fit(model, seq_batch(8, 8, seed=5), global_batch_size=8, optimizer=sgd(model.parameters()),
                         memory_budget=200_000, device="cpu", techniques=("checkpointing",))
    assert again.source == "cache" and again.micro_batch_size == step.plan.micro_batch_size


def test_a_broken_cache_does_not_stop_training(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("AUTOTUNE_CACHE", str(blocker / "plans.db"))  # cannot be created
    plan = make_plan(4, 8, budget=peak_of(make_plan(2, 8), new_model(), seq_batch(8, 32)), key="some-key")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cache may warn; the point is that the step goes on
        _, step, losses = run_plan(plan, new_model(), [seq_batch(8, 32)])
    assert step.recoveries and math.isfinite(losses[0])


# -- Hugging Face models ---------------------------------------------------------------------------------------

@pytest.mark.slow  # importing transformers takes seconds
def test_hf_gpt2_checkpointing_rungs_match_the_plain_rung_as_lengths_change():
    # Regression: HF decoder layers append to their KV cache in forward, and the checkpoint's recompute
    # appended again ("size of tensor a (64) must match ... b (32)").
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_layer=2, n_embd=16, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()
    g = torch.Generator().manual_seed(0)
    batches = []
    for t in (8, 16, 32):
        ids = torch.randint(0, 64, (4, t), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    want, _, want_losses = run_plan(make_plan(2, 4), model, batches)
    for checkpointing in ("full", "selective"):
        got, _, losses = run_plan(make_plan(2, 4, checkpointing=checkpointing), model, batches)
        assert losses == pytest.approx(want_losses, rel=TOL)
        for p, q in zip(got.parameters(), want.parameters()):
            assert (p - q).norm() <= TOL * q.norm()
