"""Checkpoints under the optimizer state partitioned over two gloo ranks: each rank keeps the masters and
moments of its own runs of parameters, so `model.state_dict()` and `optimizer.state_dict()` gather the other
rank's (a collective every rank calls, as with FSDP's state dicts); rank 0 saves them. FSDP2-sharded models, with
and without optimizer offload, save and load through torch's distributed checkpoint API (`get_state_dict` /
`set_state_dict`, full state dicts). Two new ranks load the checkpoint before or after `plan.apply` and resume
to the bitwise result of the uninterrupted run.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.slow  # two spawns of two ranks: about 25 s on a 2-core machine

# name -> plan.sharding; "fsdp2" cases shard the model and save through torch's distributed checkpoint API;
# "optimizer-state-sharded" keeps nothing on the host, each rank 1/world of the state on its device
CASES = {"partitioned": "none", "optimizer-state-sharded": "optimizer_state", "fsdp2-offload": "none",
         "fsdp2-bf16": "none"}
MODES = ("load-before-apply", "load-after-apply")
TIMEOUT_S = 240


def _plan(case: str, world: int):
    from test_checkpoint_resume import N, plan_for

    plan = plan_for("bf16" if case == "fsdp2-bf16" else "optimizer-offload")
    plan = plan.with_config(world_size=world, global_batch_size=N * world)
    if CASES[case] == "optimizer_state":
        plan = plan.with_config(offload="none", offload_fraction=None, sharding="optimizer_state")
    return plan


def _run(case: str, rank: int, world: int, folder: str, mode: str) -> dict:
    """`whole`: train, checkpoint at SAVED_AT (rank 0 saves); else resume from it. Saves the final weights."""
    import torch.distributed as dist
    from test_checkpoint_resume import SAVED_AT, STEPS, Net, adamw, batch

    from autotune.techniques.offload import HostOptimizer
    from autotune.techniques.sharding import shard
    from autotune.training.step import TrainingStep

    ckpt = os.path.join(folder, f"{case}.pt")
    fsdp = case.startswith("fsdp2")
    torch.manual_seed(0 if mode == "whole" else 1)  # a resumed model starts from other weights
    model = shard(Net()) if fsdp else Net()
    opt = adamw(model)
    save, load = (_dcp_save, _dcp_load) if fsdp else (_save, _load)
    if mode == "load-before-apply":
        load(model, opt, torch.load(ckpt))
    step = TrainingStep(_plan(case, world), model, opt)
    host = step.optimizer
    if mode == "load-after-apply":
        load(model, opt, torch.load(ckpt))
    dtypes: list[str] = []
    for k in range(0 if mode == "whole" else SAVED_AT, STEPS):
        if mode == "whole" and k == SAVED_AT:
            state = save(model, opt)  # every rank: collectives
            dtypes = sorted({str(v.dtype) for v in state["model"].values()})
            if rank == 0:
                torch.save(state, ckpt)
            dist.barrier()
        step(batch(k + 10 * rank))  # each rank its own share of the global batch
    partitioned = (isinstance(host, HostOptimizer) and bool(host.shares.foreign)) or fsdp
    step.close()
    final = _dcp_save(model, opt)["model"] if fsdp else model.state_dict()
    torch.save(final, os.path.join(folder, f"{case}.{mode}.rank{rank}.pt"))
    return {"partitioned": partitioned, "dtypes": dtypes}


def _save(model, opt) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _load(model, opt, saved: dict) -> None:
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])


def _dcp_save(model, opt) -> dict:
    """Full (unsharded) state dicts through torch's distributed checkpoint API, as FSDP2 users save them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, opt, options=options)
    return {"model": model_state, "optimizer": optimizer_state}


def _dcp_load(model, opt, saved: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"],
                   options=StateDictOptions(full_state_dict=True))


def _rank_main(rank: int, world: int, init_file: str, out_dir: str, folder: str, phase: str) -> None:
    """Phase "whole" trains every case; phase "resume" runs every (case, mode) pair, scenario "<case> <mode>"."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ranks import run_scenarios

    def run(name: str, r: int, w: int) -> dict:
        case, mode = name.split(" ") if phase == "resume" else (name, "whole")
        return _run(case, r, w, folder, mode)

    names = tuple(CASES) if phase == "whole" else tuple(f"{case} {mode}" for case, mode in PAIRS)
    run_scenarios(rank, world, init_file, out_dir, names, run)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Two spawns: ranks that train and save, then new ranks that resume in both modes (each case and mode from
    a model and optimizer of its own, so one pair of processes serves them all)."""
    from ranks import spawn

    folder = str(tmp_path_factory.mktemp("ranks"))
    return {"folder": folder, "whole": spawn(_rank_main, 2, TIMEOUT_S, folder, "whole"),
            "resume": spawn(_rank_main, 2, TIMEOUT_S, folder, "resume")}


# torch's distributed checkpoint API loads a full optimizer state only into an optimizer whose state exists
# (it reads the local layout first); under optimizer offload that is after the first step, so an FSDP2 user
# loads it before `plan.apply` (or after a step), as the README says.
PAIRS = [(case, mode) for case in CASES for mode in MODES if (case, mode) != ("fsdp2-offload", "load-after-apply")]


@pytest.mark.parametrize(("case", "mode"), PAIRS)
def test_partitioned_state_resumes_bitwise_on_two_ranks(runs, case, mode):
    for phase, name in (("whole", case), ("resume", f"{case} {mode}")):
        for rank, result in enumerate(runs[phase]):
            assert result[name]["ok"], f"{name}, rank {rank}:\n{result[name].get('error')}"
    assert all(r[case]["partitioned"] for r in runs["whole"])  # each rank stepped (or held) only its part
    assert runs["whole"][0][case]["dtypes"] == ["torch.float32"]  # the other rank's masters, not 16-bit copies
    for rank in range(2):
        want = torch.load(os.path.join(runs["folder"], f"{case}.whole.rank{rank}.pt"))
        got = torch.load(os.path.join(runs["folder"], f"{case}.{mode}.rank{rank}.pt"))
        differ = [k for k in want if not torch.equal(want[k], got[k])]
        assert not differ, f"rank {rank}: {len(differ)} of {len(want)} tensors differ, e.g. {differ[:3]}"
