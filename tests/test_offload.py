"""Optimizer offload on the CPU test device: overlapped with backward, partial, and 8-bit state.

The overlapped step must give the parameters of the serial one, bitwise: both run the same per-parameter
optimizer arithmetic on the same FP32 gradients, only the order in which tensors are stepped differs. The
chunk size is made tiny here so that a small model still has many chunks for the worker thread to step.
"""

from __future__ import annotations

import copy
import json
import os
import runpy
import sys

import pytest
import torch
from torch import nn

import autotune
from autotune.configuration import Rung
from autotune.errors import InvalidSetting
from autotune.evidence import Trial
from autotune.plan import Plan
from autotune.search.trial import OVERLAPPED
from autotune.techniques import optimizer_8bit, parse_techniques
from autotune.techniques.offload import (
    HostOptimizer,
    HostSteppedEngine,
    StreamedEngine,
    build_engine,
    host_share,
    norm_parameters,
)
from autotune.techniques.offload import pipeline as offload_pipeline
from autotune.techniques.offload import streamed as offload_stream
from autotune.training.step import TrainingStep
from autotune.workload.batching import global_step_seconds, solve_accumulation
from autotune.workload.optimizers import OptimizerSpec

HUGE = 2**40  # a budget nothing reaches: the ceiling is on, but never hit
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# The offload modules' defaults, before the fixtures here and in test_offload_stream.py shrink them.
CHUNK_ELEMENTS, SEGMENT = offload_pipeline.CHUNK_ELEMENTS, offload_stream.SEGMENT


@pytest.fixture(autouse=True)
def small_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(offload_pipeline, "CHUNK_ELEMENTS", 200)
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "plans.db"))
    monkeypatch.delenv("AUTOTUNE_TECHNIQUES", raising=False)
    monkeypatch.delenv("AUTOTUNE_OFFLOAD_OVERLAP", raising=False)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 3 * width)
        self.down = nn.Linear(3 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    """`model(x, y)`: mean squared error; x (B, T, 3), y (B, T). A few thousand parameters in 14 tensors."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(3, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return ((self.head(h).squeeze(-1) - y) ** 2).mean()


def batches(n: int, count: int, t: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, t, 3, generator=g), torch.randn(n, t, generator=g)) for _ in range(count)]


def make_plan(micro: int, n: int, *, precision: str = "bf16", fraction: float | None = None) -> Plan:
    steps, last = solve_accumulation(n, micro)
    return Plan.of(precision=precision, checkpointing="none", offload="optimizer", offload_fraction=fraction,
                micro_batch_size=micro, accumulation_steps=steps, world_size=1, global_batch_size=n,
                last_micro_batch_size=last, peak_memory_bytes=0, memory_budget_bytes=HUGE, margin=0.1,
                samples_per_second=0.0, device="cpu")


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def train(plan: Plan, data, monkeypatch, *, overlap: bool, make_opt=adamw, **kwargs):
    """A fresh model (same seed every time) trained with `plan` over `data`; the model, step and user optimizer."""
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_OVERLAP", "1" if overlap else "0")
    torch.manual_seed(0)
    model = Net()
    opt = make_opt(model.parameters())
    step = TrainingStep(plan, model, opt, **kwargs)
    for b in data:
        step(b)
    return model, step, opt


def stepped_by_worker(step: TrainingStep) -> int:
    engine = step.optimizer
    pipeline = engine.pipeline if isinstance(engine, HostSteppedEngine) else None  # streamed: no pipeline
    return 0 if pipeline is None else pipeline.chunks_stepped


def assert_bitwise(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), f"{name} differs"


# -- overlap: the same parameters as the serial step --------------------------------------------------------

@pytest.mark.parametrize("precision,clip", [("bf16", None), ("bf16", 0.05), ("fp16", None)],
                         ids=["bf16", "bf16-clipped", "fp16-gradscaler"])
def test_overlapped_offload_gives_the_serial_parameters(monkeypatch, precision, clip):
    plan = make_plan(3, 8, precision=precision)  # 3 + 3 + 2: an uneven last micro-batch
    data = batches(8, 4)
    serial, s_step, s_opt = train(plan, data, monkeypatch, overlap=False, max_grad_norm=clip)
    overlapped, o_step, o_opt = train(plan, data, monkeypatch, overlap=True, max_grad_norm=clip)
    assert stepped_by_worker(s_step) == 0
    assert_bitwise(overlapped, serial)
    if precision == "fp16":  # the loss scale took the same path
        assert o_step.optimizer.scaler.get_scale() == s_step.optimizer.scaler.get_scale()
    else:
        assert (stepped_by_worker(o_step) > 0) == (clip is None)  # clipping defers every CPU step to step()
    s_step.close()
    o_step.close()
    assert_bitwise(overlapped, serial)  # FP32 weights back from the same masters
    for a, b in zip(s_opt.state_dict()["state"].values(), o_opt.state_dict()["state"].values()):
        # Under FP16 the first scale (2^16) overflows and that step is skipped, by both alike.
        assert float(a["step"]) == float(b["step"]) == len(data) - (precision == "fp16")
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_overlap_follows_the_users_learning_rate(monkeypatch):
    # The worker steps during backward: the LR a scheduler wrote must reach it before then.
    plan = make_plan(4, 8)
    data = batches(8, 2)
    for overlap in (False, True):
        monkeypatch.setenv("AUTOTUNE_OFFLOAD_OVERLAP", "1" if overlap else "0")
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = TrainingStep(plan, model, opt)
        step(data[0])
        for group in opt.param_groups:  # what an LR scheduler does
            group["lr"] = 0.0
        before = [p.detach().clone() for p in model.parameters()]
        step(data[1])
        assert stepped_by_worker(step) == (len(step.optimizer.pipeline.chunks) * 2 if overlap else 0)
        moved = [n for (n, p), b in zip(model.named_parameters(), before) if not torch.equal(p, b)]
        assert moved == [], f"lr 0 moved {moved}"
        step.close()


# -- partial offload ------------------------------------------------------------------------------------------

def test_host_share_takes_the_last_parameters_up_to_the_fraction():
    numels = [100, 10, 50, 40]
    assert host_share(numels, 1.0) == [0, 1, 2, 3]
    assert host_share(numels, 0.0) == []
    assert host_share(numels, 0.2) == [3]  # 40 of 200
    assert host_share(numels, 0.21) == [2, 3]  # 90 of 200: the fewest reaching the share
    assert host_share(numels, 90 / 200) == [2, 3]


@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_partial_offload_steps_the_rest_on_the_device(monkeypatch, fraction):
    data = batches(8, 3)
    serial, s_step, _ = train(make_plan(3, 8, fraction=fraction), data, monkeypatch, overlap=False)
    got, step, opt = train(make_plan(3, 8, fraction=fraction), data, monkeypatch, overlap=True)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731 - an update proportional to the gradient
    partial_sgd, p_step, _ = train(make_plan(3, 8, fraction=fraction), data, monkeypatch, overlap=True, make_opt=sgd)
    full, f_step, _ = train(make_plan(3, 8), data, monkeypatch, overlap=True, make_opt=sgd)
    host = step.optimizer.shares
    assert 0 < host.fraction < 1 and abs(host.fraction - fraction) < 0.2
    params = list(got.parameters())
    masters = host.device_master
    assert sorted(masters) == host.device_index and set(host.device_index).isdisjoint(host.host_index)
    for i in host.device_index:  # stepped on the device: an FP32 master there, the same 16-bit weight as offloaded
        assert masters[i].dtype == torch.float32 and masters[i].device == params[i].device
        if params[i].dim() > 1:
            assert params[i].dtype == torch.bfloat16 and torch.equal(masters[i].to(torch.bfloat16), params[i])
    assert_bitwise(got, serial)
    # Against full offload: the same forward and gradients (16-bit weights either way), the same FP32 update
    # arithmetic; only the CPU's fused kernel and the device's single-tensor one may round differently.
    flat = lambda m: torch.cat([p.detach().float().flatten() for p in m.parameters()])  # noqa: E731
    assert (flat(partial_sgd) - flat(full)).norm() <= 1e-3 * flat(full).norm()
    step.close()
    state = opt.state_dict()["state"]
    assert len(state) == len(params) and all(float(s["step"]) == len(data) for s in state.values())
    for s_ in (s_step, p_step, f_step):
        s_.close()


def test_partial_offload_uses_less_device_memory_than_none_and_more_than_full(monkeypatch):
    from autotune.techniques import apply_rung  # noqa: F401 - imported for the plan's rung
    data = batches(4, 2)

    def peak(fraction: float | None) -> int:
        plan = make_plan(4, 4, fraction=fraction)
        _, step, _ = train(plan, data, monkeypatch, overlap=True)
        step.close()
        return step.last_peak_bytes

    full, half = peak(None), peak(0.5)
    assert full < half
    n = sum(p.numel() for p in Net().parameters())
    # Moving a share back to the device costs FP32 weights + gradients + two AdamW moments: 12 more bytes each.
    assert half - full <= 12 * n * 0.7


# -- the search: the smallest host share that fits -------------------------------------------------------------

class Wide(nn.Module):
    """Weights dominate its memory (AdamW: 16 bytes a parameter without offload), activations are small."""

    def __init__(self, width: int = 96, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().mean()


def second_step_peak(plan: Plan, model: nn.Module, batch, make_opt=None) -> int:
    m = copy.deepcopy(model)
    step = TrainingStep(plan, m, make_opt(m) if make_opt else torch.optim.AdamW(m.parameters()))
    step(batch)  # the optimizer state appears at the first step
    step(batch)
    step.close()
    return step.last_peak_bytes


def test_a_budget_between_none_and_full_offload_gets_a_partial_share():
    torch.manual_seed(0)
    model = Wide()
    batch = torch.randn(4, 96)
    on_host = second_step_peak(make_plan(4, 4), model, batch)  # full optimizer offload at micro-batch 4
    plain = make_plan(1, 4).with_config(offload="none", offload_fraction=None)
    on_device = second_step_peak(plain, model, batch)  # no offload at micro-batch 1
    assert on_host < on_device / 2
    budget = int((on_host + on_device) / 2 / 0.9)  # the limit (90% of it) halfway between the two
    plan = autotune.fit(copy.deepcopy(model), batch, global_batch_size=4, memory_budget=budget, device="cpu",
                        cache=False, techniques=("bf16", "offload"), max_trials=8)
    # Which micro-batch wins is a timing (2 and 4 trade places on a loaded 2-core machine); at every size
    # the plain rung is over the limit (it is at micro-batch 1) and full offload leaves room, so the share is
    # partial whichever wins.
    assert plan.offload == "optimizer"
    assert 0 < plan.offload_fraction < 1, plan.reason
    limit = 0.9 * budget
    assert plan.peak_memory_bytes <= limit
    share, overlapped = plan.trials[-2], plan.trials[-1]
    assert "offload fraction" in share.note and share.fits
    # Then the same configuration with its measured steps overlapped, against the serial one: the plan keeps
    # the faster, and says by how much.
    assert OVERLAPPED in overlapped.note
    assert (overlapped.rung, overlapped.micro_batch_size) == (share.rung, share.micro_batch_size)
    serial_s = share.step_seconds + share.optimizer_seconds
    overlapped_s = overlapped.step_seconds + overlapped.optimizer_seconds
    assert plan.offload_overlap is (overlapped.fits and overlapped_s < serial_s)
    assert ("overlapped optimizer offload:" if plan.offload_overlap else "serial optimizer offload:") in plan.reason
    # The estimate is of the step the plan trains: overlapped, the once-a-step part shortened by what it saved
    once = share.optimizer_seconds - (serial_s - overlapped_s) if plan.offload_overlap else share.optimizer_seconds
    expected = 4 / global_step_seconds(share.step_seconds, max(0.0, once), 4, share.micro_batch_size)
    assert plan.samples_per_second == pytest.approx(expected, rel=1e-9)
    assert plan.offload_overlap is not None
    # Training with the plan splits as the trial did and stays under the limit too.
    m = copy.deepcopy(model)
    step = plan.apply(m, torch.optim.AdamW(m.parameters()))
    for _ in range(2):
        step(batch)
    assert step.last_peak_bytes <= limit and step.recoveries == []
    assert abs(step.optimizer.shares.fraction - plan.offload_fraction) < 1e-12
    assert (step.optimizer.pipeline is not None) == plan.offload_overlap
    step.close()


def top_only(model: Wide) -> torch.optim.Optimizer:
    """An optimizer over the top half of the layers; `requires_grad` is left on below, where nobody trains."""
    return torch.optim.AdamW(model.layers[6:].parameters(), lr=1e-2)


def test_an_optimizer_over_the_top_layers_tunes_onto_a_partial_share_and_trains_them_alone():
    """The share search splits what the optimizer trains; the layers below, outside every group, get no host
    master or state and are trained by nobody, as in plain PyTorch."""
    torch.manual_seed(0)
    model = Wide()
    batch = torch.randn(4, 96)
    on_host = second_step_peak(make_plan(4, 4), model, batch, top_only)
    plain = make_plan(1, 4).with_config(offload="none", offload_fraction=None)
    on_device = second_step_peak(plain, model, batch, top_only)
    budget = int((on_host + 3 * on_device) / 4 / 0.9)  # a share of the optimized layers' state on the host fits
    tuned = copy.deepcopy(model)
    plan = autotune.fit(tuned, batch, global_batch_size=4, memory_budget=budget, device="cpu", cache=False,
                        optimizer=top_only(tuned), techniques=("bf16", "offload"), max_trials=8)
    assert plan.offload == "optimizer" and 0 < plan.offload_fraction < 1, plan.reason
    m = copy.deepcopy(model)
    step = plan.apply(m, top_only(m))
    below = [p for layer in m.layers[:6] for p in layer.parameters()]
    assert {id(p) for p in step.optimizer.shares.params}.isdisjoint(map(id, below))  # no master, no state for them
    for _ in range(2):
        step(batch)
    assert step.recoveries == [] and step.last_peak_bytes <= 0.9 * budget
    step.close()
    for a, b in zip(m.parameters(), model.parameters()):
        assert torch.equal(a, b) == any(a is p for p in below)  # the lower layers as they were, the top trained


@pytest.mark.parametrize("fraction", [0.5, 0.2, 1.0])
def test_a_partial_optimizer_under_offload_steps_as_plain_pytorch(fraction):
    """float64 keeps its weights on the device under optimizer offload, so the step is exact: the top layers'
    update is the plain PyTorch one whatever share of them is on the host, and the lower ones are untouched."""
    torch.manual_seed(0)
    model = Wide(width=8).double()
    data = [torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    want = copy.deepcopy(model)
    opt = top_only(want)
    for x in data:
        want(x).backward()
        opt.step()
        opt.zero_grad()
    got = copy.deepcopy(model)
    user = top_only(got)
    plan = make_plan(4, 6, precision="fp32", fraction=fraction)  # 4 + 2 micro-batches
    with plan.apply(got, user) as step:
        held = {id(p) for p in step.optimizer.shares.params}
        assert held == {id(p) for p in got.layers[6:].parameters()}  # no master or state for the lower layers
        for x in data:
            step(x)
        state = user.state_dict()["state"]
    assert len(state) == 6 and all(float(s["step"]) == len(data) for s in state.values())
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    assert all(torch.equal(a, b) for a, b in zip(got.layers[:6].parameters(), model.layers[:6].parameters()))


def test_a_trial_overlaps_its_warm_up_and_measures_serial_steps_unless_asked(monkeypatch):
    # Training overlaps only the last of k backwards; a trial measured with every step overlapped priced
    # all k that way (4-20% under the trained rate on an H100). The warm-up step still overlaps: its peak
    # is the last backward's, which the meter must see.
    from autotune.configuration import Rung
    from autotune.devices.placement import resolve_device
    from autotune.search.trial import TrialRunner, Workload
    from autotune.workload.losses import resolve

    armed = []
    def counted(arm):
        return lambda self, defer=False: (armed.append(1), arm(self, defer))[1]

    for engine in (HostSteppedEngine, StreamedEngine):
        monkeypatch.setattr(engine, "arm", counted(engine.arm))
    model = Net()
    work = Workload(model=model, batch=batches(4, 1)[0], loss_fn=resolve(None),
                    spec=OptimizerSpec.from_user(None, model), placement=resolve_device("cpu"), budget_bytes=HUGE,
                    limit_bytes=int(0.9 * HUGE), per_rank=8,
                    warmup_steps=1, measured_steps=4)  # not the default count: all 4 run, steady or not
    rung = Rung(precision="bf16", offload="optimizer")
    for overlap in (False, True):
        armed.clear()
        trial = TrialRunner(work)(rung, 4, overlap=overlap)
        # Overlapped: the warm-up and at least the 4 measured steps (a noisy CPU trial measures more).
        assert trial.fits and (len(armed) >= 5 if overlap else len(armed) == 1)
        assert (OVERLAPPED in trial.note) == overlap


@pytest.mark.parametrize("planned,env,pipelined", [(None, "1", True), (True, "1", True), (False, "1", False),
                                                    (True, "0", False)])
def test_the_plans_overlap_choice_is_applied_and_the_variable_can_turn_it_off(monkeypatch, planned, env, pipelined):
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_OVERLAP", env)
    plan = make_plan(4, 8).with_config(offload_overlap=planned)
    model = Net()
    step = plan.apply(model, adamw(model.parameters()))
    step(batches(8, 1)[0])
    assert (step.optimizer.pipeline is not None) == pipelined
    assert stepped_by_worker(step) == (len(step.optimizer.pipeline.chunks) if pipelined else 0)
    assert ("(serial)" in plan.summary()) == (planned is False)
    step.close()


# -- 8-bit optimizer state --------------------------------------------------------------------------------------

def test_optimizer_8bit_is_opt_in():
    assert "optimizer_8bit" not in parse_techniques(None)
    assert "optimizer_8bit" in parse_techniques("bf16,optimizer_8bit")


def test_optimizer_8bit_allowed_but_not_installed_names_the_packages(monkeypatch):
    for name in ("torchao", "torchao.optim", "bitsandbytes", "bitsandbytes.optim"):
        monkeypatch.setitem(sys.modules, name, None)  # what an absent package looks like to `import`
    model, batch = Wide(), torch.randn(4, 96)
    with pytest.raises(InvalidSetting,
                       match=r"'optimizer_8bit' needs torchao or bitsandbytes.*pip install torchao.*'optim8bit' extra"):
        autotune.fit(model, batch, global_batch_size=4, memory_budget=2**30, device="cpu", cache=False,
                     techniques=("bf16", "optimizer_8bit"))
    autotune.fit(model, batch, global_batch_size=4, memory_budget=2**30, device="cpu", cache=False,
                 techniques=("bf16",), max_trials=2)  # not asked for: no package needed


def test_optimizer_8bit_needs_adam():
    model = Wide()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InvalidSetting, match="Adam and AdamW only, and the optimizer is SGD"):
        optimizer_8bit.eight_bit_spec(OptimizerSpec.from_user(sgd, model), "cpu")


def test_8bit_state_is_chosen_when_it_is_the_only_thing_that_fits():
    pytest.importorskip("torchao.optim")  # a real 8-bit AdamW; the test extra installs torchao
    torch.manual_seed(0)
    model, batch = Wide(), torch.randn(4, 96)
    plain = make_plan(1, 4).with_config(offload="none", offload_fraction=None)
    eight = plain.with_config(optimizer_8bit=True)
    full, small = second_step_peak(plain, model, batch), second_step_peak(eight, model, batch)
    n = sum(p.numel() for p in model.parameters())
    # 8 bytes of AdamW state a parameter became about 2; the step's FP32 temporaries (per parameter) eat
    # part of that at the peak.
    assert full - small >= 2 * n
    budget = int((full + small) / 2 / 0.9)
    # One measured step a trial: torchao's 8-bit AdamW steps slowly on the CPU, and only what fits is under test.
    kw = dict(global_batch_size=4, memory_budget=budget, device="cpu", cache=False, max_trials=8, trial_steps=1)
    with pytest.raises(autotune.NoFeasiblePlan):
        autotune.fit(copy.deepcopy(model), batch, techniques=("bf16",), **kw)
    plan = autotune.fit(copy.deepcopy(model), batch, techniques=("bf16", "optimizer_8bit"), **kw)
    assert plan.optimizer_8bit and plan.offload == "none" and "8-bit optimizer" in plan.reason
    assert plan.peak_memory_bytes <= 0.9 * budget
    m = copy.deepcopy(model)
    step = plan.apply(m, torch.optim.AdamW(m.parameters(), lr=1e-3))
    losses = [step(batch) for _ in range(3)]
    assert losses[-1] < losses[0] and step.last_peak_bytes <= 0.9 * budget
    assert type(step.optimizer).__name__ == "AdamW8bit"
    state = step.optimizer.state[next(m.parameters())]
    assert type(state["exp_avg"]).__name__ == "OptimState8bit"


# -- an attempt that fails in the armed backward ----------------------------------------------------------------

def host_optimizer(model: nn.Module, *, overlap: bool) -> HostOptimizer:
    return build_engine(list(model.parameters()), OptimizerSpec.from_user(None, model), torch.bfloat16,
                        keep_fp32=norm_parameters(model), overlap=overlap)


def backward(model: nn.Module, batch) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(*batch)
    loss.backward()


def rerun_matches_serial(host: HostOptimizer, serial: HostOptimizer, model: nn.Module, ref: nn.Module, batch) -> None:
    """After `host.abort()`: the re-run batch (armed again) steps `model` as one serial step steps `ref`,
    bitwise, each parameter once."""
    host.zero_grad()
    host.arm()
    backward(model, batch)
    host.step()
    backward(ref, batch)
    serial.step()
    assert_bitwise(model, ref)
    steps = sorted(float(s["step"]) for s in host.shares.optimizer.state.values())
    assert steps == [1.0] * len(list(model.parameters()))


def test_chunks_stepped_before_an_aborted_backward_are_not_stepped_again():
    # What TrainingStep does when the last backward runs out of memory after the worker stepped some
    # chunks: abort(), drop the gradients, re-run the batch, step. The stepped chunks keep their update (made
    # with the whole batch's gradient at the old weights, which stay on the device until the step), the rest
    # are stepped with the re-run's gradients: the parameters of one serial step, each stepped once.
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    batch = batches(4, 1)[0]
    host, serial = host_optimizer(model, overlap=True), host_optimizer(ref, overlap=False)
    host.arm()
    backward(model, batch)
    host.pipeline.drain()  # the worker has stepped every chunk whose gradients all landed
    assert host.pipeline.done
    old = [p.detach().clone() for p in model.parameters()]
    host.abort()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), old))  # nothing written back yet
    rerun_matches_serial(host, serial, model, ref, batch)
    host.restore()
    serial.restore()
    assert_bitwise(model, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_overlap_on_cuda_gives_the_serial_parameters(monkeypatch, fraction):
    # The CUDA path: pinned 16-bit staging, the side stream, events, copies back after backward.
    data = [tuple(t.cuda() for t in b) for b in batches(8, 3)]

    # the CPU step's pipeline (streamed has none: test_offload_stream.py)
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_STREAM", "0")

    def run(overlap: bool) -> nn.Module:
        monkeypatch.setenv("AUTOTUNE_OFFLOAD_OVERLAP", "1" if overlap else "0")
        torch.manual_seed(0)
        model = Net(width=256).cuda()
        plan = make_plan(3, 8, fraction=fraction).with_provenance(device="cuda")
        step = TrainingStep(plan, model, adamw(model.parameters()))
        for b in data:
            step(b)
        if overlap and fraction == 1.0:
            assert step.optimizer.pipeline.chunks_stepped > 0
        step.close()
        return model

    assert_bitwise(run(True), run(False))


def run_benchmark(monkeypatch, script: str, *args: str) -> None:
    """`python benchmarks/SCRIPT ARGS` run in this process (a process of its own spends seconds importing torch),
    as from a shell: without $AUTOTUNE_*, with the offload modules' defaults; what the script changes (the
    variables it sets, the stream's segment size, sys.path) is put back after the test."""
    for name in [k for k in os.environ if k.startswith("AUTOTUNE_")]:
        monkeypatch.delenv(name)
    for name in ("AUTOTUNE_OFFLOAD_OVERLAP", "AUTOTUNE_OFFLOAD_STREAM"):  # set by the script, unset after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(offload_pipeline, "CHUNK_ELEMENTS", CHUNK_ELEMENTS)
    monkeypatch.setattr(offload_stream, "SEGMENT", SEGMENT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    path = os.path.join(ROOT, "benchmarks", script)
    monkeypatch.setattr(sys, "argv", [path, *args])
    runpy.run_path(path, run_name="__main__")


@pytest.mark.slow  # seconds: a benchmark script's four modes of training
def test_bench_offload_runs_every_mode_on_the_cpu(tmp_path, monkeypatch):
    out = tmp_path / "offload.jsonl"
    run_benchmark(monkeypatch, "bench_offload.py", "--workload", "tiny", "--config", "0,4,0.5", "--steps", "1",
                  "--warmup", "1", "--out", str(out), "--modes", "serial,overlap,stream-serial,stream-overlap")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["serial", "overlap", "stream-serial", "stream-overlap"]
    for r in rows:
        assert r["fraction"] == 0.5 and r["steps"] == 1 and r["recoveries"] == 0
        assert 0 < r["tail_s"] < r["step_s"] and abs(r["backward_s"] + r["tail_s"] - r["step_s"]) < 1e-9
    assert rows[0]["chunks"] == 0 and rows[1]["chunks"] >= 1  # the serial step has no pipeline
    assert rows[2]["chunks"] == 0 and rows[3]["chunks"] >= 1  # streamed: segments from the hooks only when overlapped
    assert rows[3]["chunks_before_tail"] == rows[3]["chunks"]  # every segment issued during the last backward


@pytest.mark.slow  # seconds: two benchmark scripts' trials and training steps
def test_bench_trial_accuracy_and_profile_step_run_on_the_cpu(tmp_path, monkeypatch):
    # The two scripts behind the trial-accuracy and sync-point figures, on the tiny CPU workload.
    out = tmp_path / "acc.jsonl"
    for script in ("bench_trial_accuracy.py", "profile_step.py"):
        run_benchmark(monkeypatch, script, "--workload", "tiny", "--config", "0,4", "--steps", "1", "--warmup", "1",
                      "--out", str(out))
    accuracy, profile = [json.loads(line) for line in out.read_text().splitlines()]
    for key in ("estimate_armed_True", "estimate_armed_False", "trained_overlap", "trained_serial"):
        assert accuracy[key] > 0, accuracy
    assert profile["wall_s"] > 0 and profile["cpu_top"] and profile["micro"] == 4


def test_an_8bit_plan_follows_the_users_learning_rate():
    pytest.importorskip("torchao.optim")
    torch.manual_seed(0)
    model, batch = Wide(), torch.randn(4, 96)
    plan = make_plan(2, 4).with_config(offload="none", offload_fraction=None,
                                       optimizer_8bit=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = plan.apply(model, opt)
    step(batch)
    assert all(float(s["step"]) == 1 for s in step.optimizer.state.values())
    for group in opt.param_groups:  # what an LR scheduler does
        group["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    step(batch)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(float(s["step"]) == 2 for s in step.optimizer.state.values())


def test_a_partial_plan_says_its_share():
    assert "bf16+optimizer offload of 40% of the parameters, micro-batch 3" in make_plan(3, 8, fraction=0.4).summary()
    assert "bf16+optimizer offload, micro-batch 3" in make_plan(3, 8).summary()


class SharedReentrant(nn.Module):
    """One weight used by two regions of reentrant checkpointing: its gradient is accumulated by two nested
    backwards, so it is 'final' twice in one backward."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 16)
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.shared, torch.tanh(self.first(x)), use_reentrant=True)
        h = torch.utils.checkpoint.checkpoint(self.shared, torch.tanh(h), use_reentrant=True)
        return ((self.head(h).squeeze(-1) - y) ** 2).mean()


def test_a_gradient_that_grows_after_it_was_final_is_never_used_silently():
    batch = batches(4, 1)[0]
    torch.manual_seed(0)
    model = SharedReentrant()
    ref = copy.deepcopy(model)
    host, serial = host_optimizer(model, overlap=True), host_optimizer(ref, overlap=False)
    host.arm()
    backward(model, batch)
    backward(ref, batch)
    serial.step()
    try:
        host.step()
    except RuntimeError as exc:  # the worker had stepped the shared weight on its first half
        assert "use_reentrant=False" in str(exc) and "AUTOTUNE_OFFLOAD_OVERLAP=0" in str(exc)
    else:  # it had not: the weight was copied again and stepped after backward, as the serial step does
        assert_bitwise(model, ref)
    assert host.pipeline.disabled  # no more overlap for this model
    host.arm()
    assert not host.pipeline.armed


def _priced(offload: str, micro: int, step: float, opt: float, *, compile: bool = True, per_rank: int = 64) -> Trial:
    from autotune.workload.batching import global_step_seconds

    rate = per_rank / global_step_seconds(step, opt, per_rank, micro)
    return Trial(rung=Rung(offload=offload, compile=compile), micro_batch_size=micro, outcome="ok",
                 peak_bytes=2**30, step_seconds=step, optimizer_seconds=opt, samples_per_second=rate)


def test_an_offload_rival_is_priced_at_a_share_only_where_it_can_win():
    """GPT-2 medium at 16 GiB on an H100: compile without offload (4 x 16) beat compile with every parameter's
    optimizer on the host (6 x 11), which trained 1.12x faster with 65% there (RESULTS.md, third session)."""
    from autotune.search.offload_share import offload_rival

    plain = _priced("none", 4, 0.055, 0.02)  # 72 samples/s
    full = _priced("optimizer", 6, 0.068, 0.35)  # 58: its host step is a third of the global step
    assert full.samples_per_second < plain.samples_per_second
    assert offload_rival([plain, full], plain, 64, 0.03) is full  # 11 micro-steps alone: 86 samples/s
    slow = _priced("optimizer", 6, 0.09, 0.35)  # even with no host step at all: 65, not past the pick
    assert offload_rival([plain, slow], plain, 64, 0.03) is None
    assert offload_rival([plain, full], full, 64, 0.03) is None  # the pick is offload's already


def test_the_rival_at_its_share_replaces_the_pick_only_when_faster_by_more_than_noise():
    from autotune.search.ledger import Ledger
    from autotune.search.offload_share import rival_or_pick
    from autotune.search.plan_reason import account

    def ledger(trials: list[Trial]) -> Ledger:
        return Ledger(runner=lambda rung, micro: plain, per_rank=64, limit=2**30, cap=64, max_trials=24,
                      trials=trials, pick=plain, head="pick")

    plain = _priced("none", 4, 0.055, 0.02)
    for shared, wins in ((_priced("optimizer", 6, 0.068, 0.12), True), (_priced("optimizer", 6, 0.068, 0.2), False)):
        state = rival_or_pick(ledger([plain, shared]), shared, 0.65)
        assert (state.pick is shared, state.fraction) == ((True, 0.65) if wins else (False, None)), \
            shared.samples_per_second
        assert account(state).endswith("pick")
        assert ("65% of the parameters' optimizer on the host" in account(state)) == wins
        assert any("not faster than the pick" in n for n in state.notes) != wins
    state = rival_or_pick(ledger([plain]), None, 1.0)
    assert (state.pick, state.fraction) == (plain, None) and "no share on the device fitted" in state.notes[0]
