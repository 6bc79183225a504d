"""Joining a spawned test rank to its gloo group: the one place the rank processes' setup lives.

Every multi-rank test spawns its ranks on a 2-core CI machine. Two settings keep them honest there:
- one intra-op thread per rank: 4 ranks at torch's default (one thread per core) oversubscribe the cores
  several times over, and under FSDP the simulated ceiling then saw the ranks reach different counts (a
  gloo thread releasing a buffer earlier on one rank), so one rank ran out of memory inside a forward while
  the others waited in FSDP's all-gather: a hang that held CI past its limit;
- a collective timeout well under the parent's join deadline, so a collective left waiting fails on the ranks
  with gloo's own error (reported to the parent) instead of hanging until the parent kills them.

A rank also leaves through `leave`: it writes its result, waits until every rank has written one (so no rank
closes its connections while another still waits on it in the last collective: gloo's sends are asynchronous,
and a rank that returns from a barrier first can tear the group down under a slower one's feet), then exits
with `os._exit`, skipping the interpreter's teardown, where gloo's worker threads can still hold tensors and
abort the process ("terminate called without an active exception") after its work is done.
"""

from __future__ import annotations

import datetime
import multiprocessing
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

# Ranks start from a fork server that imported torch and autotune once per test process, rather than each
# rank importing them again (about 3 s of CPU a rank on a 2-core machine); the server runs no torch op before
# it forks, so no thread pool or device state is carried into the ranks. FSDP and Dynamo are preloaded too:
# each rank otherwise imports them on its first sharded or optimizer call (about 1.5 s of CPU a rank).
START_METHOD = "forkserver"
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.fsdp", "torch._dynamo",
                                        "autotune"])

COLLECTIVE_TIMEOUT_S = 120  # under test_distributed_step's 180 s join deadline
LEAVE_WAIT_S = 60  # how long a finished rank waits for the others' results before it leaves anyway


def join(rank: int, world: int, init_file: str, backend: str = "gloo") -> None:
    """Join the group; under NCCL (two GPUs, tests/test_nccl_gpu.py) on GPU `rank`."""
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def run_scenarios(rank: int, world: int, init_file: str, out_dir: str, scenarios, run, backend: str = "gloo") -> None:
    """A spawned rank's body: join, run each scenario (`run(name, rank, world)` -> dict), and `leave` with
    rank<N>.json holding {"ok": ..., **result} or the traceback per scenario, a barrier after each scenario."""
    import os
    import time
    import traceback

    os.environ["AUTOTUNE_CACHE"] = "off"  # recovery writes to the default cache: keep the tests off it
    join(rank, world, init_file, backend)
    results: dict = {}
    seconds: dict = {}
    try:
        for name in scenarios:
            start = time.perf_counter()
            try:
                results[name] = {"ok": True, **run(name, rank, world)}
            except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
                results[name] = {"ok": False, "error": traceback.format_exc()}
            seconds[name] = round(time.perf_counter() - start, 2)  # which scenario is slow, for whoever tunes them
            dist.barrier()  # a scenario that failed on one rank must not leave the next one out of step
    finally:
        leave(rank, world, out_dir, {**results, "_seconds": seconds})


def leave(rank: int, world: int, out_dir: str, result) -> None:
    """Write `result` to rank<N>.json, wait for every rank's file, tear the group down and exit the process."""
    import json
    import os
    import sys
    import time

    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".part", "w") as f:
        json.dump(result, f)
    os.replace(path + ".part", path)  # the others and the parent only ever see a whole file
    deadline = time.monotonic() + LEAVE_WAIT_S
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(out_dir, f"rank{r}.json")) for r in range(world)):
            break
        time.sleep(0.05)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(rank_main, world: int, timeout_s: int, *args) -> list[dict]:
    """Spawn `world` ranks of `rank_main(rank, world, init_file, out_dir, *args)`; their JSON results.
    Ranks that do not finish within `timeout_s` are killed and the test fails."""
    import json
    import os
    import tempfile

    import pytest
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(rank_main, args=(world, os.path.join(tmp, "init"), tmp, *args), nprocs=world,
                                 join=False, start_method=START_METHOD)
        for _ in range(timeout_s):
            if ctx.join(timeout=1):
                break
        else:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world} ranks did not finish within {timeout_s} s (a collective left waiting?)")
        return [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]


def join_within(ctx: Any, seconds: float, what: str) -> None:
    """Wait for the ranks `ctx` started (torch.multiprocessing); past `seconds`, kill them and fail the test. A rank
    that raised or exited non-zero raises here, as `ctx.join` does."""
    deadline = time.monotonic() + seconds
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{what}: the ranks did not finish within {seconds} s")
