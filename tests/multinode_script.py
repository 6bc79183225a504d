"""One rank of a simulated two-node job, started by torchrun (tests/test_multinode.py starts two torchrun
invocations, `--nnodes 2`, side by side on this machine).

It tunes a small float64 model whose replicated weights and gradients are over the limit, so `fit` shards it,
and on two nodes searches flat FSDP2 and hybrid sharding both. Then one step of the plan, and the rank writes
what it saw to OUT_DIR/rank<N>.json.

Usage: torchrun ... multinode_script.py OUT_DIR
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import traceback

import torch
import torch.distributed as dist

WIDTH, DEPTH, PER_RANK = 64, 8, 4


def main(out_dir: str) -> None:
    torch.set_num_threads(1)  # four ranks on two cores (tests/ranks.py says why)
    os.environ["AUTOTUNE_CACHE"] = "off"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"rank": rank, "group_rank": int(os.environ["GROUP_RANK"])}
    try:
        result.update(run(rank, world))
        result["ok"] = True
    except Exception:  # noqa: BLE001 - reported to the test, which fails
        result.update(ok=False, error=traceback.format_exc())
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".part", "w") as f:
        json.dump(result, f)
    os.replace(path + ".part", path)
    dist.barrier()  # no rank tears the group down under another still in a collective
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's teardown, where gloo's threads can abort a finished process


def run(rank: int, world: int) -> dict:
    from test_step import Net, seq_batch

    import autotune
    from autotune.parallel.topology import digest
    from autotune.techniques.sharding import is_sharded

    torch.manual_seed(0)
    model = Net(width=WIDTH, depth=DEPTH).to(torch.float64)
    batch = seq_batch(PER_RANK, 6, seed=60 + rank)

    # AdamW's replicated floor (float64 weights, gradients, two moments) is 8.1 MiB, over the 6.3 MiB limit: sharded
    # over a node's 2 ranks it fits, over all 4 too.
    plan = autotune.fit(model, batch, global_batch_size=PER_RANK * world, memory_budget="7MiB", device="cpu",
                        cache=False, trial_steps=1, techniques=("checkpointing",), progress=False)
    step = plan.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss = step(batch)
    assert math.isfinite(loss) and is_sharded(model)
    config = {k: v for k, v in plan.config.to_dict().items() if k != "max_length"}
    return {"nodes": plan.config.nodes, "sharding": plan.sharding, "micro": plan.micro_batch_size,
            "reason": plan.reason, "digest": digest(config), "loss": loss,
            "trials": [[t.rung.name, t.micro_batch_size, t.outcome, t.note] for t in plan.trials],
            "uneven_trials": _uneven(rank, world)}


def _uneven(rank: int, world: int) -> list[list]:
    """A second fit where only the last rank (on node 1) holds 16x longer samples: its activations run out of
    memory at a micro-batch the other ranks take (their samples fit at 4, above), and every rank must fail
    that trial with it and go on to the same plan."""
    from test_step import Net, seq_batch

    import autotune

    torch.manual_seed(0)
    model = Net(width=WIDTH, depth=DEPTH).to(torch.float64)
    batch = seq_batch(PER_RANK, 96 if rank == world - 1 else 6, seed=70 + rank)
    plan = autotune.fit(model, batch, global_batch_size=PER_RANK * world, memory_budget="7MiB", device="cpu",
                        cache=False, trial_steps=1, techniques=("checkpointing",), progress=False)
    return [[t.rung.name, t.micro_batch_size, t.outcome] for t in plan.trials]


if __name__ == "__main__":
    main(sys.argv[1])
