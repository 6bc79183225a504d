"""Optimizer offload follows torch's optimizer semantics, `grad is None` included, and the
`before_optimizer_step` callback sees the same gradients under every plan.

Plain torch steps only the parameters whose `.grad` is set: one that got no gradient in a step (a head used
on some batches only, an MoE expert that got no tokens, a branch not taken) gets no weight decay, no moment
update and no step count, and one never used yet has no state at all. The yardstick is that plain step, in
float64, where optimizer offload keeps the device weights in their own dtype and the step is exact: every
engine (serial, overlapped, streamed, a partial share stepped on the device) must give torch's weights to
1e-12 and torch's per-parameter step counts.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from autotune.plan import Plan
from autotune.techniques.offload import HostSteppedEngine, StreamedEngine
from autotune.techniques.offload import pipeline as offload_pipeline
from autotune.techniques.offload import streamed as offload_stream
from autotune.workload.batching import solve_accumulation

HUGE = 2**40  # a budget nothing reaches: the ceiling is on, but never hit
N = 6  # samples a step: micro-batches of 4 + 2
# Which head each step uses: `first` in step 1 only and again in step 4; `late` first in step 3 (its first
# step count is 1 there, as torch keeps it per parameter); neither in steps 2 and 5.
USES = [(1, 0), (0, 0), (0, 1), (1, 1), (0, 0)]


@pytest.fixture(autouse=True)
def small_pieces(tmp_path, monkeypatch):
    # Chunks and segments that mix a head used in every step with one used in some: [late, main.bias],
    # [main.weight, first], [trunk] for the worker thread; [trunk.weight], [trunk.bias .. late.weight], [late]
    # for the streamed step.
    monkeypatch.setattr(offload_pipeline, "CHUNK_ELEMENTS", 10)
    monkeypatch.setattr(offload_stream, "SEGMENT", 32)
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "plans.db"))
    monkeypatch.delenv("AUTOTUNE_TECHNIQUES", raising=False)


class Heads(nn.Module):
    """`model(x, y, first, late)`: a trunk and a main head always, two more heads where the batch's flags say
    (every sample of a step carries the same flag); mean squared error."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 8)
        self.first = nn.Linear(8, 1)
        self.main = nn.Linear(8, 1)
        self.late = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, first: torch.Tensor, late: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        out = self.main(h)
        if bool(first[0]):
            out = out + self.first(h)
        if bool(late[0]):
            out = out + self.late(h)
        return ((out.squeeze(-1) - y) ** 2).mean()


def data() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for first, late in USES:
        out.append((torch.randn(N, 4, generator=g, dtype=torch.float64),
                    torch.randn(N, generator=g, dtype=torch.float64),
                    torch.full((N,), first), torch.full((N,), late)))
    return out


def make_plan(*, offload: str, fraction: float | None = None) -> Plan:
    steps, last = solve_accumulation(N, 4)
    return Plan.of(precision="fp32", checkpointing="none", offload=offload, offload_fraction=fraction,
                   micro_batch_size=4, accumulation_steps=steps, world_size=1, global_batch_size=N,
                   last_micro_batch_size=last, peak_memory_bytes=0, memory_budget_bytes=HUGE, margin=0.1,
                   samples_per_second=0.0, device="cpu")


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-2, weight_decay=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=3e-2, weight_decay=0.1),  # L2 decay: folded into the gradient
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=3e-2, momentum=0.9, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=3e-2, weight_decay=0.1),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=3e-2, weight_decay=0.1),
}
# (environment, fraction): the serial CPU step, the overlapped one (the worker steps chunks in backward),
# the streamed one serial and overlapped (Adam and AdamW only), and a partial share: the trunk and `first`
# stepped on the device.
ENGINES = {
    "serial": ({"AUTOTUNE_OFFLOAD_OVERLAP": "0", "AUTOTUNE_OFFLOAD_STREAM": "0"}, None),
    "overlapped": ({"AUTOTUNE_OFFLOAD_OVERLAP": "1", "AUTOTUNE_OFFLOAD_STREAM": "0"}, None),
    "streamed": ({"AUTOTUNE_OFFLOAD_OVERLAP": "0", "AUTOTUNE_OFFLOAD_STREAM": "1"}, None),
    "streamed-overlapped": ({"AUTOTUNE_OFFLOAD_OVERLAP": "1", "AUTOTUNE_OFFLOAD_STREAM": "1"}, None),
    "share-on-host": ({"AUTOTUNE_OFFLOAD_OVERLAP": "1", "AUTOTUNE_OFFLOAD_STREAM": "0"}, 0.2),  # main, late
}


def plain(model: nn.Module, make_opt, batches) -> tuple[list[list[torch.Tensor]], dict]:
    """Plain torch full-batch steps: the weights after each step, and the optimizer's state dict at the end."""
    opt = make_opt(model.parameters())
    after = []
    for b in batches:
        model(*b).backward()
        opt.step()
        opt.zero_grad()
        after.append([p.detach().clone() for p in model.parameters()])
    return after, opt.state_dict()


def steps_of(state_dict: dict) -> dict[int, float]:
    return {k: float(s["step"]) for k, s in state_dict["state"].items() if "step" in s}


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_parameter_without_a_gradient_is_not_stepped_under_offload(monkeypatch, name, engine):
    env, fraction = ENGINES[engine]
    streamed = env["AUTOTUNE_OFFLOAD_STREAM"] == "1"
    if streamed and name not in ("adamw", "adam"):
        pytest.skip("only Adam and AdamW stream")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    torch.manual_seed(0)
    model = Heads().double()
    batches = data()
    want, want_state = plain(copy.deepcopy(model), OPTIMIZERS[name], batches)
    opt = OPTIMIZERS[name](model.parameters())
    plan = make_plan(offload="optimizer", fraction=fraction)
    if env["AUTOTUNE_OFFLOAD_OVERLAP"] == "1":
        plan = plan.with_config(offload_overlap=True)  # as fit decides it: the streamed step overlaps only then
    with plan.apply(model, opt) as step:
        assert isinstance(step.optimizer, StreamedEngine) == streamed
        for k, b in enumerate(batches):
            step(b)
            for (pname, got), w in zip(model.named_parameters(), want[k]):
                torch.testing.assert_close(got, w, rtol=0, atol=1e-12, msg=f"{pname} after step {k + 1}")
        got_state = opt.state_dict()
        pipeline = step.optimizer.pipeline if isinstance(step.optimizer, HostSteppedEngine) else None
        assert (pipeline is not None and pipeline.chunks_stepped > 0) == (engine in ("overlapped", "share-on-host"))
        if engine == "streamed-overlapped":
            assert step.optimizer.stepper.early > 0  # segments issued from the hooks in backward
    # `first` stepped in steps 1 and 4, `late` in 3 and 4, the others in all five (SGD counts no steps)
    assert steps_of(got_state) == steps_of(want_state)
    assert got_state["state"].keys() == want_state["state"].keys()
    for k, entry in want_state["state"].items():
        for key, value in entry.items():
            mine = got_state["state"][k][key]
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(mine, value, rtol=0, atol=1e-12, msg=f"state {k} {key}")
            else:
                assert mine == value, f"state {k} {key}"


def test_the_unused_heads_step_counts_are_torchs_per_parameter(monkeypatch):
    """AdamW under overlapped offload: `late` has step 1 at its first gradient (step 3 of training), and a
    head whose state exists keeps it untouched through a step without a gradient."""
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_OVERLAP", "1")
    torch.manual_seed(0)
    model = Heads().double()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1)
    names = [n for n, _ in model.named_parameters()]
    with make_plan(offload="optimizer").with_config(offload_overlap=True).apply(model, opt) as step:
        batches = data()
        step(batches[0])
        kept = {k: v.clone() for k, v in opt.state_dict()["state"][names.index("first.weight")].items()}
        step(batches[1])
        after = opt.state_dict()["state"]
        assert names.index("late.weight") not in after  # never used: no state, as torch keeps none
        assert all(torch.equal(after[names.index("first.weight")][k], v) for k, v in kept.items())
        step(batches[2])
        counts = {names[k]: float(s["step"]) for k, s in opt.state_dict()["state"].items()}
    assert counts == {"trunk.weight": 3, "trunk.bias": 3, "first.weight": 1, "first.bias": 1, "main.weight": 3,
                      "main.bias": 3, "late.weight": 1, "late.bias": 1}


def clipped_run(offload: str) -> tuple[list[list[torch.Tensor | None]], nn.Module]:
    """Three clipped SGD steps under a plan: the gradients `before_optimizer_step` saw at each, and the model."""
    torch.manual_seed(0)
    model = Heads().double()
    seen = []

    def look(step):
        seen.append([None if p.grad is None else p.grad.clone() for p in step.model.parameters()])

    with make_plan(offload=offload).apply(model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=0.05,
                                          before_optimizer_step=look) as step:
        for b in data()[:3]:
            step(b)
        assert step.last_grad_norm > 0.05  # it clips for real
    return seen, model


def test_before_optimizer_step_sees_the_clipped_gradients_on_every_plan():
    """The callback runs after clipping (its documented place, and where a plain loop's code between
    `clip_grad_norm_` and `optimizer.step()` looks), so it sees the clipped gradient under optimizer offload
    as on a plain plan; and what it leaves there is what the optimizer steps with."""
    torch.manual_seed(0)
    ref = Heads().double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for b in data()[:3]:
        ref(*b).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        want.append([None if p.grad is None else p.grad.clone() for p in ref.parameters()])
        opt.step()
        opt.zero_grad()
    names = [n for n, _ in ref.named_parameters()]
    for offload in ("none", "optimizer"):
        seen, model = clipped_run(offload)
        for k, (mine, theirs) in enumerate(zip(seen, want, strict=True)):
            for name, a, b in zip(names, mine, theirs):
                assert (a is None) == (b is None), f"{offload}: {name} at step {k + 1}"
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=f"{offload}: {name} at step {k + 1}")
        for name, p, q in zip(names, model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12, msg=f"{offload}: {name}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stream,overlap", [(True, False), (True, True), (False, False), (False, True)],
                         ids=["streamed", "streamed-overlapped", "cpu-serial", "cpu-overlapped"])
def test_on_cuda_a_head_without_a_gradient_keeps_its_weights_and_state(monkeypatch, stream, overlap):
    """The CUDA paths (the GPU stepping the streamed share on its streams; pinned staging and the side stream
    of the CPU step's pipeline) under BF16: a head's 16-bit weights stay bitwise as they were through a step
    without its gradient (a decay of lr x weight_decay = 5% would show), and its state and count with them."""
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_STREAM", "1" if stream else "0")
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_OVERLAP", "1" if overlap else "0")
    torch.manual_seed(0)
    model = Heads().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    plan = make_plan(offload="optimizer").with_config(precision="bf16", offload_overlap=True if overlap else None)
    batches = [tuple(t.float().cuda() if t.is_floating_point() else t.cuda() for t in b) for b in data()]
    names = [n for n, _ in model.named_parameters()]
    counts = {n: 0 for n in names}
    with plan.with_provenance(device="cuda").apply(model, opt) as step:
        assert isinstance(step.optimizer, StreamedEngine) == stream
        for b, (first, late) in zip(batches, USES):
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            state = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                     for k, s in opt.state_dict()["state"].items()}
            step(b)
            used = {"first": first, "late": late, "trunk": 1, "main": 1}
            after = opt.state_dict()["state"]
            for k, (name, p) in enumerate(model.named_parameters()):
                if used[name.split(".")[0]]:
                    counts[name] += 1
                    assert not torch.equal(p, before[name]), name
                    continue
                assert torch.equal(p, before[name]), name
                assert (k in after) == (k in state), name  # no state before its first gradient
                for key, value in state.get(k, {}).items():
                    assert torch.equal(torch.as_tensor(after[k][key]).cpu(), torch.as_tensor(value).cpu()), name
        got = {names[k]: float(s["step"]) for k, s in opt.state_dict()["state"].items()}
    assert got == {n: c for n, c in counts.items() if c}
