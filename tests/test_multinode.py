"""Two simulated nodes of two ranks each: two torchrun invocations (`--nnodes 2`, a c10d rendezvous on localhost)
started side by side, four gloo processes in all, running tests/multinode_script.py.

With the link between the nodes made slow (the test-only delay every collective across nodes waits), fit searches
flat FSDP2 and hybrid sharding, and keeps hybrid, whose only collective across nodes is the gradients' all-reduce;
every rank holds the same plan, for 2 nodes, and steps. A second fit, where only the last rank (on node 1) holds
samples long enough to run out of memory, fails that trial on all four and goes on to one plan.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_env import with_path

TESTS = Path(__file__).resolve().parent
TIMEOUT_S = 240  # a guard against a hang: collectives time out on the ranks first (multinode_script.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(out: Path, delay_ms: int) -> list[dict]:
    port = _free_port()
    env = with_path(TESTS, TESTS.parent, AUTOTUNE_TEST_CROSS_NODE_DELAY_MS=str(delay_ms), OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                               f"localhost:{port}", "--rdzv-id", f"autotune-test-{port}", "--max-restarts", "0",
                               str(TESTS / "multinode_script.py"), str(out)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    logs = []
    try:
        for p in nodes:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in nodes:
            p.kill()
        pytest.fail(f"the two nodes did not finish within {TIMEOUT_S} s")
    results = []
    for rank in range(4):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote nothing:\n" + "\n".join(log[-3000:] for log in logs)
        results.append(json.loads(path.read_text()))
    return results


@pytest.mark.slow  # four processes importing torch on two cores, three searches under FSDP2
def test_two_nodes_agree_on_one_plan_pick_hybrid_over_a_slow_link_and_share_one_ranks_oom(tmp_path: Path) -> None:
    # A link slow enough that the pauses, not the ranks' compute, set both plans' rates: flat FSDP2 waits it on every
    # gather and reduce-scatter, hybrid once a unit a step; a shorter one leaves them within noise of each other where
    # a busy neighbour slows one plan's one-step trials.
    ranks = _two_nodes(tmp_path, delay_ms=50)
    for r in ranks:
        assert r["ok"], r.get("error")
    assert sorted(r["group_rank"] for r in ranks) == [0, 0, 1, 1]
    assert {r["nodes"] for r in ranks} == {2}
    assert len({r["digest"] for r in ranks}) == 1  # the same plan on every rank (fit also checked it)
    reason = ranks[0]["reason"]
    assert {r["sharding"] for r in ranks} == {"hsdp"}, reason
    assert reason.startswith("hybrid sharding (over the 2 ranks of each of 2 nodes, replicated across)"), reason
    assert "x the flat plan's" in reason and "across nodes measured" in reason, reason
    trials = [[t[:3] for t in r["trials"]] for r in ranks]
    assert all(t == trials[0] for t in trials)  # every rank ran and agreed on the same trials
    # Only node 1's last rank ran out of memory; the trial failed on all four, and they went on together.
    uneven = [r["uneven_trials"] for r in ranks]
    assert all(t == uneven[0] for t in uneven), uneven
    assert any(outcome == "oom" for _, micro, outcome in uneven[0] if micro <= 4), uneven[0]
