"""Hybrid sharding on two simulated nodes of two ranks each (two torchrun invocations, `--nnodes 2`, a c10d
rendezvous on localhost; four gloo processes), then one node of two ranks (from the test's fork server, with
torchrun's environment), running tests/multinode_hsdp_script.py:
one hybrid-sharded step equals the single-process float64 step; a torch.distributed.checkpoint saved on 2 x 2
resumes bitwise on 2 x 2 and, resharded by torch, on 1 x 2, where the two-node plan itself is refused; and a
rank killed in `fit` is named by its node and local rank in the error the other node's ranks raise.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from subprocess_env import with_path

TESTS = Path(__file__).resolve().parent
TIMEOUT_S = 180  # a guard against a hang: collectives time out on the ranks first (60 s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out: Path, mode: str, nodes: int) -> str:
    """`nodes` torchrun invocations of two ranks each, side by side; their output."""
    port = _free_port()
    env = with_path(TESTS, TESTS.parent, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"autotune-test-{port}",
               "--max-restarts", "0", str(TESTS / "multinode_hsdp_script.py"), mode, str(out)]
    launches = []
    for _ in range(nodes):
        launches.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        # The first torchrun binds the endpoint and hosts the job's store (torchrun ends the job when that
        # agent goes): started alone first, it is node 0's, and the rank that dies is on the other node.
        _wait_for_port(port, launches[0])
    logs = []
    try:
        for p in launches:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in launches:
            p.kill()
        pytest.fail(f"{mode}: the launches did not finish within {TIMEOUT_S} s")
    return "\n".join(log[-4000:] for log in logs)


def _wait_for_port(port: int, first: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and first.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)


def _one_node(out: Path) -> None:
    """The one-node job: two ranks started from this process's fork server, which has torch and autotune
    imported already (a torchrun launch imports them in three new processes), with the environment torchrun
    gives the ranks of one node of two."""
    import torch.multiprocessing as mp
    from ranks import START_METHOD, join_within

    ctx = mp.start_processes(_one_node_rank, args=(2, _free_port(), str(out)), nprocs=2, join=False,
                             start_method=START_METHOD)
    try:
        join_within(ctx, TIMEOUT_S, "one-node")
    except mp.ProcessExitedException:
        pass  # a rank whose scenario failed exits with 1: its report says why


def _one_node_rank(rank: int, world: int, port: int, out: str) -> None:
    sys.path.insert(0, str(TESTS))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import multinode_hsdp_script

    multinode_hsdp_script.main("one-node", out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hsdp")
    logs = _torchrun(out, "two-nodes", nodes=2)
    (out / "logs.txt").write_text(logs)
    if (out / "whole.pt").exists():  # the one-node resume needs the two-node checkpoint
        _one_node(out)
    return out


def _results(out: Path, scenario: str, ranks: range) -> list[dict]:
    results = []
    for rank in ranks:
        path = out / f"{scenario}.rank{rank}.json"
        assert path.exists(), f"{scenario}: rank {rank} wrote nothing:\n{(out / 'logs.txt').read_text()}"
        results.append(json.loads(path.read_text()))
    return results


def _ok(out: Path, scenario: str, ranks: range) -> list[dict]:
    results = _results(out, scenario, ranks)
    for rank, r in zip(ranks, results):
        assert r["ok"], f"{scenario}, rank {rank}:\n{r['error']}"
    return results


@pytest.mark.slow  # two torchrun launches of four and two processes on two cores
def test_a_hybrid_sharded_step_equals_the_single_process_float64_step(runs: Path) -> None:
    ranks = _ok(runs, "exact", range(4))  # each rank checked its gathered weights and loss to 1e-9
    assert {tuple(r["mesh"]) for r in ranks} == {(2, 2)}  # 2 nodes (replicated) x 2 ranks (sharded)
    assert ranks[0]["mesh_dims"] == ["replicate", "shard"]
    assert len({r["loss"] for r in ranks}) == 1


@pytest.mark.slow
def test_a_hybrid_checkpoint_resumes_bitwise_on_two_nodes(runs: Path) -> None:
    ranks = _ok(runs, "checkpoint", range(4))  # each rank compared the resumed weights with torch.equal
    assert ranks[0]["tensors"] > 0 and (runs / "hsdp-checkpoint").is_dir()


@pytest.mark.slow
def test_a_hybrid_checkpoint_resumes_on_one_node_where_the_two_node_plan_is_refused(runs: Path) -> None:
    ranks = _ok(runs, "resume-elsewhere", range(2))  # resharded to 1 x 2 by torch: equal to 1e-9
    for r in ranks:
        assert r["refusal"].startswith("InvalidSetting"), r["refusal"]
        assert "2 nodes" in r["refusal"] and "this job runs on 2 ranks" in r["refusal"], r["refusal"]


@pytest.mark.slow
def test_a_rank_killed_in_fit_is_named_by_node_and_local_rank_on_the_other_node(runs: Path) -> None:
    # Node 1's torchrun stops its other rank once rank 3 dies; node 0's ranks raise, after a roll call.
    ranks = _results(runs, "death", range(2))
    for rank, r in enumerate(ranks):
        assert not r["ok"] and r["type"] == "RankDied", r.get("error")
        assert "rank 3 (node 1, local rank 1, host " in r["message"], r["message"]
        assert f"a collective on rank {rank} (node 0, local rank {rank}, host " in r["message"], r["message"]
