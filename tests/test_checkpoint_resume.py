"""Checkpoints under every plan: `model.state_dict()` and `optimizer.state_dict()` saved mid-training, loaded
in a new process before or after `plan.apply`, resume to the bitwise result of the uninterrupted run.

Under optimizer offload the device holds 16-bit working copies and the FP32 masters and moments live in
the host optimizer; a checkpoint must hold those (not the 16-bit copies), and a load after `apply` must
reach them (not be overwritten at the next step, nor rounded to the device weights' dtype on the way).
The resumed half runs in a spawned process, so nothing but the checkpoint file carries over.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from autotune.plan import Plan
from autotune.training.step import TrainingStep
from autotune.workload.batching import solve_accumulation

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest.py

STEPS, SAVED_AT = 4, 2  # train 4 steps; the checkpoint is taken after 2
N, T = 6, 5  # samples per batch, positions per sample

# name -> plan fields and the environment the step is built under
CASES: dict[str, tuple[dict, dict]] = {
    "fp32": (dict(precision="fp32"), {}),
    "bf16": (dict(precision="bf16"), {}),
    "bf16-checkpointing": (dict(precision="bf16", checkpointing="full"), {}),
    "activation-offload": (dict(precision="bf16", checkpointing="full", offload="activations"), {}),
    "optimizer-offload": (dict(precision="bf16", offload="optimizer"), {}),
    "optimizer-offload-serial": (dict(precision="bf16", offload="optimizer", offload_overlap=False), {}),
    "optimizer-offload-partial": (dict(precision="bf16", offload="optimizer", offload_fraction=0.5), {}),
    "optimizer-offload-streamed": (dict(precision="bf16", offload="optimizer"), {"AUTOTUNE_OFFLOAD_STREAM": "1"}),
    "optimizer-8bit": (dict(precision="bf16", optimizer_8bit=True), {}),  # torchao's AdamW8bit in the user's place
    "fp16": (dict(precision="fp16"), {}),
    "fp16-optimizer-offload": (dict(precision="fp16", offload="optimizer"), {}),  # the loss scale: step.state_dict()
}
MODES = ("load-before-apply", "load-after-apply")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 3 * width)
        self.down = nn.Linear(3 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    """`model(x, y)`: mean squared error; x (B, T, 3), y (B, T). FP32, so optimizer offload has masters to keep."""

    def __init__(self, width: int = 64, depth: int = 3) -> None:  # (64, 192) weights: 8-bit state in torchao
        super().__init__()
        self.inp = nn.Linear(3, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return ((self.head(h).squeeze(-1) - y) ** 2).mean()


def plan_for(case: str) -> Plan:
    fields, _ = CASES[case]
    steps, last = solve_accumulation(N, 2)
    return Plan.of(**{**dict(checkpointing="none", offload="none"), **fields}, micro_batch_size=2,
                accumulation_steps=steps, world_size=1, global_batch_size=N, last_micro_batch_size=last,
                peak_memory_bytes=0, memory_budget_bytes=2**40, margin=0.1, samples_per_second=0.0, device="cpu")


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(N, T, 3, generator=g), torch.randn(N, T, generator=g)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    # A small lr keeps each update far below a bf16 weight's spacing: a checkpoint of the 16-bit copies shows.
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)


def environment(case: str) -> dict[str, str | None]:
    """Set the case's environment; what it replaced, to put back."""
    _, env = CASES[case]
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    return old


def put_back(old: dict[str, str | None]) -> None:
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_first_half(case: str, path: str) -> dict[str, torch.Tensor]:
    """The uninterrupted run's weights at the end; on the way, the checkpoint at SAVED_AT, saved to `path`."""
    old = environment(case)
    try:
        torch.manual_seed(0)
        model = Net()
        opt = adamw(model)
        step = TrainingStep(plan_for(case), model, opt)
        for k in range(STEPS):
            if k == SAVED_AT:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step.state_dict()},
                           path)
            step(batch(k))
        step.close()
        return weights(model)
    finally:
        put_back(old)


def resume(case: str, mode: str, path: str) -> dict[str, torch.Tensor]:
    """A fresh model (other initial weights) resumed from the checkpoint at `path`, trained to the end."""
    old = environment(case)
    try:
        torch.manual_seed(1)
        model = Net()
        opt = adamw(model)
        checkpoint = torch.load(path, weights_only=False)  # our own file; torchao's 8-bit state is a tensor subclass
        if mode == "load-before-apply":
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["optimizer"])
        step = TrainingStep(plan_for(case), model, opt)
        step.load_state_dict(checkpoint["step"])  # FP16's loss scale
        if mode == "load-after-apply":
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["optimizer"])
        for k in range(SAVED_AT, STEPS):
            step(batch(k))
        step.close()
        return weights(model)
    finally:
        put_back(old)


def _resume_all(folder: str, threads: int) -> None:
    """The spawned process: every case and mode resumed from its checkpoint, the results saved beside it."""
    torch.set_num_threads(threads)  # as the parent: a CPU reduction's order follows the thread count
    os.environ["AUTOTUNE_CACHE"] = "off"
    for case in CASES:
        for mode in MODES:
            result = resume(case, mode, os.path.join(folder, f"{case}.pt"))
            torch.save(result, os.path.join(folder, f"{case}.{mode}.resumed.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Each case's uninterrupted result and checkpoint (here), and its resumed results (a new process)."""
    import multiprocessing

    folder = str(tmp_path_factory.mktemp("resume"))
    whole = {case: train_first_half(case, os.path.join(folder, f"{case}.pt")) for case in CASES}
    child = multiprocessing.get_context("spawn").Process(target=_resume_all, args=(folder, torch.get_num_threads()))
    child.start()
    child.join(timeout=300)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0, f"the resuming process failed (exit {child.exitcode})"
    resumed = {(case, mode): torch.load(os.path.join(folder, f"{case}.{mode}.resumed.pt"))
               for case in CASES for mode in MODES}
    return {"whole": whole, "resumed": resumed, "folder": folder}


@pytest.mark.slow  # the module's resuming process (spawned once)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_run_ends_bitwise_equal_to_the_uninterrupted_one(runs, case, mode):
    want, got = runs["whole"][case], runs["resumed"][(case, mode)]
    assert want.keys() == got.keys()
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, f"{case}, {mode}: {len(differ)} of {len(want)} tensors differ, e.g. {differ[:3]}"


@pytest.mark.slow  # the module's resuming process (spawned once)
@pytest.mark.parametrize("case", list(CASES))
def test_the_checkpoint_holds_fp32_weights_and_state(runs, case):
    checkpoint = torch.load(os.path.join(runs["folder"], f"{case}.pt"), weights_only=False)
    assert {v.dtype for v in checkpoint["model"].values()} == {torch.float32}
    state = checkpoint["optimizer"]["state"]
    assert state and len(state) == len(checkpoint["model"])  # every parameter's, none lost
    if case == "optimizer-8bit":  # the 8-bit optimizer's own state: block-quantized where a weight is large
        assert any(type(s["exp_avg"]).__name__ == "OptimState8bit" for s in state.values())
    else:
        assert all(s["exp_avg_sq"].dtype == torch.float32 and type(s["exp_avg_sq"]) is torch.Tensor
                   for s in state.values())


def offload_step_taken() -> tuple[Net, torch.optim.Optimizer, TrainingStep]:
    """A model, its AdamW and an optimizer-offload step that has taken one step: the state exists."""
    torch.manual_seed(0)
    model = Net()
    opt = adamw(model)
    step = TrainingStep(plan_for("optimizer-offload"), model, opt)
    step(batch(0))
    return model, opt, step


def test_the_checkpoint_under_optimizer_offload_is_the_masters_not_the_16_bit_copies():
    model, opt, step = offload_step_taken()
    saved = model.state_dict()
    shares = step.optimizer.shares
    masters = {id(p): shares.master[i] for i, p in enumerate(shares.params) if i in shares.master}
    named = dict(model.named_parameters())
    offloaded = [k for k, p in named.items() if p.dtype == torch.bfloat16]
    assert offloaded  # the Linear weights: 16-bit on the device, FP32 on the host (the norms' stay FP32)
    for k in offloaded:
        assert saved[k].dtype == torch.float32 and torch.equal(saved[k], masters[id(named[k])])
    # A copy: the masters are views of one pinned buffer, which a safetensors save refuses as shared memory.
    assert len({v.untyped_storage().data_ptr() for v in saved.values()}) == len(saved)
    step.close()


def test_a_load_after_apply_is_what_the_next_step_trains_from():
    model, opt, step = offload_step_taken()
    torch.manual_seed(5)
    other = Net().state_dict()  # another model's FP32 weights
    model.load_state_dict(other)
    for group in opt.param_groups:
        group["lr"] = 0.0  # no update: the weights after the step are the loaded ones, at full precision
        group["weight_decay"] = 0.0
    step(batch(1))
    now = model.state_dict()
    assert all(torch.equal(now[k], other[k]) for k in other)
    step.close()
    assert all(torch.equal(p, other[k]) for k, p in model.named_parameters())


def test_an_optimizer_state_loaded_after_apply_keeps_full_precision():
    model, opt, step = offload_step_taken()
    saved = opt.state_dict()
    # Moments no 16-bit float can hold: a load that rounded them through the device weights' dtype shows.
    exact = {k: {**s, "exp_avg_sq": s["exp_avg_sq"] + 1e-7 * torch.rand_like(s["exp_avg_sq"])}
             for k, s in saved["state"].items()}
    opt.load_state_dict({**saved, "state": {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
                                            for k, s in exact.items()}})
    back = opt.state_dict()["state"]
    assert all(torch.equal(back[k]["exp_avg_sq"], exact[k]["exp_avg_sq"]) for k in exact)
    step.close()


def test_a_second_apply_on_the_same_model_is_refused_until_the_first_is_closed():
    import autotune

    torch.manual_seed(0)
    model = Net()
    opt = adamw(model)
    plan = plan_for("optimizer-offload")
    first = plan.apply(model, opt)
    first(batch(0))
    with pytest.raises(autotune.InvalidSetting, match=r"already has an open training step.*step\.close\(\)"):
        plan.apply(model, opt)
    first.close()
    second = plan.apply(model, opt)  # closed: a new step may take the model
    second(batch(1))
    second.close()

