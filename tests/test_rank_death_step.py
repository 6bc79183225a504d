"""A rank that dies in a training step (three gloo ranks, replicated): the two left raise `RankDied` naming it by
node and local rank, after a roll call through the group's store; the collective's own error names a socket.
(tests/test_multinode_hsdp.py kills a rank in `fit` on two simulated torchrun nodes.)"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import traceback

import pytest
import ranks  # tests/ranks.py: how a test starts its ranks

WORLD, DIES = 3, 2
TIMEOUT_S = 90


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ranks import join
    from test_step import make_plan, new_model, seq_batch, sgd

    join(rank, world, init_file)
    result: dict = {}
    try:
        model = new_model()
        step = make_plan(2, 4).with_config(world_size=world, global_batch_size=4 * world).apply(
            model, sgd(model.parameters()))
        step(seq_batch(4, 6, seed=rank))  # every rank answers the first step
        if rank == DIES:
            model.blocks[0].register_forward_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
        step(seq_batch(4, 6, seed=10 + rank))
        result = {"ok": True}
    except Exception as exc:  # noqa: BLE001 - checked by the test
        result = {"ok": False, "type": type(exc).__name__, "message": str(exc), "error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # the group is broken: no teardown


@pytest.mark.slow  # three processes importing torch
def test_a_rank_killed_in_a_step_is_named_by_node_and_local_rank() -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_rank_main, args=(WORLD, os.path.join(tmp, "init"), tmp), nprocs=WORLD, join=False,
                                 start_method=ranks.START_METHOD)
        for p in ctx.processes:
            p.join(TIMEOUT_S)
        alive = [p for p in ctx.processes if p.is_alive()]
        for p in alive:
            p.kill()
        assert not alive, f"{len(alive)} ranks still running after {TIMEOUT_S} s"
        assert ctx.processes[DIES].exitcode == -signal.SIGKILL
        results = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(WORLD) if r != DIES]
    for rank, r in enumerate(results):
        assert not r["ok"] and r["type"] == "RankDied", r.get("error")
        # no torchrun here: one node, the node and local rank read from the rank numbering
        assert r["message"].startswith("rank 2 (node 0, local rank 2) stopped answering: a collective on "
                                       f"rank {rank} (node 0, local rank {rank}) failed with "), r["message"]
