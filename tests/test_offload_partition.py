"""Optimizer offload partitioned over replicated ranks (techniques/offload/partition.py), on two gloo ranks.

Each rank steps its runs of the host and device shares and broadcasts the weights; the result must be
bitwise the unpartitioned one (every rank stepping everything) for the parameters during training, the
optimizer state the user's optimizer reports (gathered from both ranks), the FP32 weights after `close()`,
and a step after that state was loaded into a fresh optimizer, with the CPU step and with the streamed one, whole share
and half, clipped or not. The device share's state, split over the ranks, must lower each rank's peak.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from autotune.techniques.offload.partition import runs

CASES = ("cpu-whole", "cpu-half-clipped", "streamed-whole", "streamed-half", "streamed-half-clipped",
         "none-on-host-clipped")  # the last: `plan.offload_fraction` 0, every master on the device, partitioned
TIMEOUT_S = 240


def _train(plan, rank: int, *, partition: bool, stream: bool, clip: float | None):
    from test_offload import Net, adamw

    from autotune.techniques.offload import StreamedEngine
    from autotune.training.step import TrainingStep

    os.environ["AUTOTUNE_OFFLOAD_PARTITION"] = "1" if partition else "0"
    os.environ["AUTOTUNE_OFFLOAD_STREAM"] = "1" if stream else "0"
    torch.manual_seed(0)
    model = Net()
    opt = adamw(model.parameters())
    step = TrainingStep(plan, model, opt, max_grad_norm=clip)
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own share of the global batch
    peaks = []
    for _ in range(3):
        step((torch.randn(5, 5, 3, generator=g), torch.randn(5, 5, generator=g)))
        peaks.append(step.last_peak_bytes)
    host = step.optimizer.shares
    layout = {"host": host.host_index, "device": host.device_index, "foreign": host.foreign,
              "stepper": isinstance(step.optimizer, StreamedEngine)}
    trained = [p.detach().clone() for p in model.parameters()]
    saved = opt.state_dict()  # through the user's optimizer: gathered from every rank
    state = copy.deepcopy(saved["state"])  # as saved (loading it below lets the optimizer step its tensors in place)
    step.close()
    closed = [p.detach().clone() for p in model.parameters()]
    # a checkpoint loaded into a fresh optimizer, one more step: each rank loads the part it steps
    again = adamw(model.parameters())
    again.load_state_dict(saved)
    step = TrainingStep(plan, model, again, max_grad_norm=clip)
    step((torch.randn(5, 5, 3, generator=g), torch.randn(5, 5, generator=g)))
    step.close()
    resumed = [p.detach().clone() for p in model.parameters()]
    return trained, state, closed, layout, max(peaks), resumed


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and bool(a) and all(
        float(a[k]["step"]) == float(b[k]["step"]) and torch.equal(a[k]["exp_avg"].cpu(), b[k]["exp_avg"].cpu())
        and torch.equal(a[k]["exp_avg_sq"].cpu(), b[k]["exp_avg_sq"].cpu()) for k in a)


def _case(name: str, rank: int, world: int) -> dict:
    from test_offload import make_plan

    stream = name.startswith("streamed")
    fraction = 0.5 if "half" in name else 0.0 if name.startswith("none-on-host") else None
    clip = 0.05 if name.endswith("clipped") else None
    plan = make_plan(2, 5, fraction=fraction if fraction != 0.0 else None)  # 2 + 2 + 1 per rank
    if fraction == 0.0:  # a plan of several ranks only (Plan refuses it on one, where it saves nothing)
        plan = plan.with_config(world_size=world, global_batch_size=5 * world, offload="none",
                                offload_fraction=None, sharding="optimizer_state")
    on = _train(plan, rank, partition=True, stream=stream, clip=clip)
    off = _train(plan, rank, partition=False, stream=stream, clip=clip)
    assert on[3]["stepper"] == stream and off[3]["foreign"] == []  # the control: unpartitioned steps everything
    return {"trained": _same(on[0], off[0]), "state": _same_state(on[1], off[1]), "closed": _same(on[2], off[2]),
            "resumed": _same(on[5], off[5]) and not _same(on[5], on[2]),
            "layout": on[3], "peak_on": on[4], "peak_off": off[4],
            "moved": any(not torch.equal(p, q) for p, q in zip(on[2], _initial()))}


def _initial() -> list[torch.Tensor]:
    from test_offload import Net

    torch.manual_seed(0)
    return [p.detach().clone() for p in Net().parameters()]


def _rank_main(rank: int, world: int, init_file: str, out_dir: str, cases: tuple[str, ...]) -> None:
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ranks import run_scenarios

    run_scenarios(rank, world, init_file, out_dir, cases, _case)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    from ranks import spawn

    return spawn(_rank_main, 2, TIMEOUT_S, CASES)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    from ranks import spawn

    return spawn(_rank_main, 4, TIMEOUT_S, ("streamed-half",))


@pytest.mark.slow  # two spawned ranks: about 15 s on a 2-core machine
@pytest.mark.parametrize("name", CASES)
def test_partitioned_offload_equals_every_rank_stepping_everything(two_ranks, name):
    _check(two_ranks, name)


@pytest.mark.slow  # four spawned ranks: about 25 s on a 2-core machine
def test_four_ranks_partition_too(four_ranks):
    _check(four_ranks, "streamed-half")


def _check(ranks: list[dict], name: str) -> None:
    results = [r[name] for r in ranks]
    for rank, res in enumerate(results):
        assert res["ok"], f"rank {rank}:\n{res.get('error')}"
        assert res["moved"], "training changed nothing: the comparison would be empty"
        assert res["trained"], f"rank {rank}: parameters differ from the unpartitioned step's"
        assert res["state"], f"rank {rank}: the gathered optimizer state differs from the unpartitioned one"
        assert res["closed"], f"rank {rank}: FP32 weights after close() differ"
        assert res["resumed"], f"rank {rank}: a step after loading the gathered state differs (or did not move)"
    # each rank stepped its own runs: together every parameter exactly once, each rank a part of each share
    own = [set(r["layout"]["host"]) | set(r["layout"]["device"]) for r in results]
    every = own[0] | set(results[0]["layout"]["foreign"])
    assert sum(len(o) for o in own) == len(every) and set().union(*own) == every  # disjoint, and all of them
    none_on_host = name.startswith("none-on-host")
    assert all(bool(r["layout"]["host"]) != none_on_host and r["layout"]["foreign"] for r in results)
    if "half" in name or none_on_host:
        assert all(r["layout"]["device"] for r in results)
        # the device share's masters and moments are split over the ranks: each rank's peak is lower
        assert all(r["peak_on"] < r["peak_off"] for r in results), [(r["peak_on"], r["peak_off"]) for r in results]


def test_runs_are_balanced_consecutive_and_never_empty():
    numels = [100, 1, 1, 1, 50, 50, 3]
    cut = runs(range(7), numels, 2)
    assert cut == [[0, 1, 2, 3], [4, 5, 6]]  # 103 elements each
    assert runs([0, 1, 2], [1000, 1, 1], 3) == [[0], [1], [2]]  # a run for each rank, however small
    assert [i for r in runs(range(7), numels, 4) for i in r] == list(range(7))
    assert all(runs(range(7), numels, 4))
