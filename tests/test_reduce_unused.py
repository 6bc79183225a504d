"""Replicated ranks leave a parameter no rank has a gradient for with `.grad` None, as DDP with
`find_unused_parameters=True` does, so the optimizer skips it as torch's does; one used on some ranks only
gets the average with zeros from the others.

Two gloo ranks train a float64 model whose `aux` head is used on rank 0 only in step 1 and on no rank in
step 2, on every replicated path that reduces gradients: the buckets all-reduced beside the last backward,
one all-reduce after it (`plan.reduce_overlap` False), the optimizer state partitioned over the ranks
(`sharding="optimizer_state"`) and optimizer offload (partitioned over the ranks too). After each step the
weights and `optimizer.state_dict()` (per-parameter step counts, moments, momentum buffers) must equal a plain
single-process torch step on the global batch to 1e-12, with AdamW (weight decay on) and SGD with momentum.
The ranks are spawned once and run every case in turn.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.slow

N = 3  # samples per rank and step: micro-batches of 2 + 1
STEPS = 2
TOL = 1e-12
TIMEOUT_S = 180
PATHS = ("overlapped", "after-backward", "partitioned-state", "offload")
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-2, weight_decay=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=3e-2, momentum=0.9, weight_decay=0.1),
}
CASES = tuple(f"{path}-{opt}" for path in PATHS for opt in OPTIMIZERS)


class Heads(nn.Module):
    """`model(x, y, aux)`: a trunk and a main head always, the `aux` head where the batch's flag says (every
    sample of a rank's share carries the same flag); mean squared error."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 8)
        self.main = nn.Linear(8, 1)
        self.aux = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        out = self.main(h)
        if bool(aux[0]):
            out = out + self.aux(h)
        return ((out.squeeze(-1) - y) ** 2).mean()


def share(step: int, rank: int) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s share of step `step`'s global batch: `aux` used by rank 0 in the first step only."""
    g = torch.Generator().manual_seed(100 * step + rank)
    uses = step == 0 and rank == 0
    return (torch.randn(N, 4, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64),
            torch.full((N,), int(uses)))


def plain(model: nn.Module, make_opt, world: int) -> list[tuple[list[torch.Tensor], dict, float]]:
    """Plain torch on one process, each step one backward over every rank's share (equal shares: the mean of
    their means); after each step the weights, the optimizer's state dict and the loss."""
    opt = make_opt(model.parameters())
    out = []
    for k in range(STEPS):
        loss = sum(model(*share(k, r)) for r in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(([p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict()),
                    float(loss.detach())))
    return out


def make_plan(path: str, world: int):
    from autotune.plan import Plan
    from autotune.workload.batching import solve_accumulation

    steps, last = solve_accumulation(N, 2)
    plan = Plan.of(precision="fp32", checkpointing="none", offload="none", micro_batch_size=2,
                   accumulation_steps=steps, world_size=1, global_batch_size=N, last_micro_batch_size=last,
                   peak_memory_bytes=0, memory_budget_bytes=2**40, margin=0.1, samples_per_second=0.0, device="cpu")
    changes = {"after-backward": {"reduce_overlap": False}, "partitioned-state": {"sharding": "optimizer_state"},
               "offload": {"offload": "optimizer"}}.get(path, {})
    return plan.with_config(world_size=world, global_batch_size=N * world, **changes)


def assert_same_state(got: dict, want: dict, when: str) -> None:
    assert got["state"].keys() == want["state"].keys(), f"{when}: state kept for {sorted(got['state'])}"
    for k, entry in want["state"].items():
        assert got["state"][k].keys() == entry.keys(), f"{when}: parameter {k}"
        for key, value in entry.items():
            torch.testing.assert_close(torch.as_tensor(got["state"][k][key]).cpu(), torch.as_tensor(value),
                                       rtol=0, atol=TOL, msg=f"{when}: parameter {k}'s {key}")


def _case(name: str, rank: int, world: int) -> dict:
    from autotune.training.step import TrainingStep

    path, opt_name = next((p, o) for p in PATHS for o in OPTIMIZERS if name == f"{p}-{o}")
    make_opt = OPTIMIZERS[opt_name]
    torch.manual_seed(0)
    model = Heads().double()
    want = plain(copy.deepcopy(model), make_opt, world)
    seen: list[bool] = []  # whether `aux` had no gradient when the optimizer was about to step, step by step
    opt = make_opt(model.parameters())
    with TrainingStep(make_plan(path, world), model, opt,
                      before_optimizer_step=lambda s: seen.append(s.model.aux.weight.grad is None)) as step:
        for k in range(STEPS):
            loss = step(share(k, rank))
            weights, state, want_loss = want[k]
            for (pname, got), w in zip(model.named_parameters(), weights):
                torch.testing.assert_close(got, w, rtol=0, atol=TOL, msg=f"{pname} after step {k + 1}")
            assert_same_state(opt.state_dict(), state, f"after step {k + 1}")  # gathered from both ranks
            assert abs(loss - want_loss) <= TOL, (loss, want_loss)
        assert (step.optimizer is not opt) == (path in ("partitioned-state", "offload")), type(step.optimizer)
    # step 1: rank 1 holds rank 0's gradient averaged with its zeros; step 2: no rank has one, so none is made
    assert seen == [False, True], seen
    return {"aux": float(model.aux.weight.sum())}


def _rank_main(rank: int, world: int, init_file: str, out_dir: str, cases: tuple[str, ...]) -> None:
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ranks import run_scenarios

    run_scenarios(rank, world, init_file, out_dir, cases, _case)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    from ranks import spawn

    return spawn(_rank_main, 2, TIMEOUT_S, CASES)


@pytest.mark.parametrize("name", CASES)
def test_a_parameter_no_rank_has_a_gradient_for_is_not_stepped(two_ranks, name):
    results = [r[name] for r in two_ranks]
    for rank, res in enumerate(results):
        assert res["ok"], f"rank {rank}:\n{res.get('error')}"
    assert results[0]["aux"] == results[1]["aux"], "ranks hold different weights"
