"""The two-GPU benchmarks on the CPU, as two gloo ranks started as torchrun starts them (bench_rank_overhead.sh
under torchrun itself): they run, and what they report is there (a broken benchmark found on the GPU machine
costs a call of scarce device time).

tiny-gpt at 5 MiB per rank: fit picks replicated optimizer offload of part of the parameters, partitioned. A global
batch of 8 (4 a rank) keeps fit's search short, and a micro-batch of 2 still accumulates two on every rank.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import tempfile

import pytest
import ranks  # tests/ranks.py: the fork server the ranks start from
import torch
import torch.multiprocessing as mp
from torch.distributed import TCPStore

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
COMMON = ["--model", "tiny-gpt", "--budget", "5MiB", "--device", "cpu", "--seq", "64", "--global-batch-size", "8"]
# One measured step per trial (after the warm-up): the benchmarks' reports are checked here, not fit's timings,
# and each of fit's trials then costs two steps instead of four on every rank.
TRIAL_STEPS = "1"
WORLD = 2
TIMEOUT_S = 600


def _rank(rank: int, port: int, script: str, args: list[str], env: dict[str, str], out_dir: str) -> None:
    """One rank as torchrun starts it: torchrun's variables (the store is the parent's, as it is torchrun's
    agent's), the script run as __main__, its stdout and stderr to files of its own."""
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(WORLD),
                      LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    for fd, name in ((1, "out"), (2, "err")):
        with open(os.path.join(out_dir, f"rank{rank}.{name}"), "w") as f:
            os.dup2(f.fileno(), fd)
    torch.set_num_threads(1)  # tests/ranks.py says why; torch read OMP_NUM_THREADS in the fork server, not here
    os.chdir(ROOT)
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _run_ranks(script: str, *args: str) -> dict:
    """The script's two ranks, forked from a process that imported torch and autotune once, where torchrun would
    start an agent and two fresh interpreters, each importing torch again (seconds of CPU each); rank 0's report."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")}
    env.update(AUTOTUNE_CACHE="off", AUTOTUNE_TRIAL_STEPS=TRIAL_STEPS, AUTOTUNE_CPU_BF16="1")  # bf16 on any CPU
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # port 0: the system picks a free one
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_rank, args=(store.port, os.path.join(ROOT, "benchmarks", script), list(args), env,
                                              tmp), nprocs=WORLD, join=False, start_method=ranks.START_METHOD)

        def output(rank: int, name: str) -> str:
            path = os.path.join(tmp, f"rank{rank}.{name}")
            if not os.path.exists(path):  # a rank that died before it opened its files
                return ""
            with open(path) as f:
                return f.read()

        try:
            ranks.join_within(ctx, TIMEOUT_S, script)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            pytest.fail(f"{exc}\n" + "\n".join(f"rank {r} {name}:\n{output(r, name)[-3000:]}"
                                                for r in range(WORLD) for name in ("out", "err")))
        stdout = output(0, "out")
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, stdout[-3000:]  # rank 0 reports
    return json.loads(lines[0])


@pytest.mark.slow  # two ranks: a search and five trainings
def test_bench_multi_gpu_trains_the_plan_at_other_shares_and_micro_batches():
    out = _run_ranks("bench_multi_gpu.py", "--case", "replicated", *COMMON, "--steps", "2", "--shares",
                     "0.5,0.001@2@one,0@2@k2", "--compare-reduce")
    assert "error" not in out, out.get("traceback")
    # fit timed the all-reduce both ways and chose; --compare-reduce trained the other way after the plan
    assert out["reduce_overlap"] in (True, False)
    assert out["reduce_other_way"]["reduce_overlap"] is not out["reduce_overlap"]
    assert out["reduce_other_way"]["tokens_per_second"] > 0
    # replicated: optimizer offload, or the optimizer state sharded over the ranks (its own sharding choice)
    assert out["world_size"] == 2 and out["sharding"] in ("none", "optimizer_state")
    assert "optimizer offload" in out["plan"] or "optimizer state sharded" in out["plan"]
    assert out["ranks_agree"] and out["weights_agree_after_close"]
    first, second, third = out["shares"]
    assert first["variant"] == "0.5" and first["offload_fraction"] == 0.5
    assert "of 50% of the parameters" in first["final_plan"]
    assert second["micro_batch_size"] == 2 and second["offload_fraction"] == 0.001
    assert "gradients all-reduced after backward" in second["final_plan"]  # @one
    assert third["offload_fraction"] == 0 and "ckpt 2 blocks" in third["final_plan"]
    assert "offload" not in third["final_plan"]
    for row in (first, second, third):
        assert "error" not in row and row["tokens_per_second"] > 0 and len(row["step_times"]) == 2


@pytest.mark.slow  # two ranks: a search and six trainings
def test_bench_replicated_parts_times_each_variant():
    variants = ["as-planned", "per-tensor", "waits", "no-agree", "no-count-sum", "parts"]
    # One step a variant: the variants train one after another on the same plan's step, so every one after the
    # first steps an optimizer whose state is built.
    out = _run_ranks("bench_replicated_parts.py", *COMMON, "--steps", "1", "--variants", ",".join(variants),
                     "--as", "0.25@2@k1")
    plan = out["plan"].split(" (fit's")[0]
    assert out["world_size"] == 2 and "ckpt 1 blocks" in plan and "of 25% of the parameters" in plan
    assert "micro-batch 2 x 2" in plan
    assert [r["variant"] for r in out["variants"]] == variants
    assert all(r["step_seconds"] > 0 and isinstance(r["gc_pauses"], dict) for r in out["variants"])
    rows = {r["variant"]: r for r in out["variants"]}
    assert set(rows["waits"]["parts"]) == {"sum_over_ranks", "agree_oom"}  # the step's agreements, timed
    assert set(rows["parts"]["parts"]) == {"micro_batches_but_last_backward", "last_backward", "all_reduce_wait",
                                           "optimizer"}


@pytest.mark.slow  # four runs (two ranks under torchrun, a pair, one alone), each with a search
def test_bench_rank_overhead_times_one_configuration_as_ranks_as_a_pair_and_alone(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")}
    # STEPS=1: the three variants train one after another on the same step, so the later two step a built state.
    env.update(AUTOTUNE_TRIAL_STEPS=TRIAL_STEPS, AUTOTUNE_CPU_BF16="1", PYTHON=sys.executable, AS="0.25@2",
               BUDGET="5MiB", BUDGET_SINGLE="8MiB", STEPS="1", GLOBAL="8",
               ARGS="--model tiny-gpt --device cpu --seq 64")
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "bench_rank_overhead.sh"), str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for run, world, batch in (("ranks", 2, 8), ("pair0", 1, 4), ("pair1", 1, 4), ("alone", 1, 4)):
        lines = [line for line in (tmp_path / f"{run}.txt").read_text().splitlines() if line.startswith("{")]
        assert len(lines) == 1, (run, (tmp_path / f"{run}.err").read_text()[-3000:])
        out = json.loads(lines[0])
        plan = out["plan"].split(" (fit's")[0]  # the plan trained, not fit's own
        assert out["world_size"] == world, (run, plan)
        assert "of 25% of the parameters" in plan and "micro-batch 2 x 2" in plan, (run, plan)
        assert f"x {world} rank(s) = {batch}" in plan
        assert [r["variant"] for r in out["variants"]] == ["as-planned", "parts", "as-planned"]
        assert set(out["variants"][1]["parts"]) == {"micro_batches_but_last_backward", "last_backward",
                                                   "all_reduce_wait", "optimizer"}


@pytest.mark.slow  # two ranks: a sharded search, then every rung
def test_bench_multi_gpu_steps_every_rung_on_shards_with_the_optimizer_form_asked():
    # A global batch of 4: every rung's step still accumulates two micro-batches of 1 a rank. One step a rung: its
    # first builds the AdamW state on the shards and steps it in the form asked.
    out = _run_ranks("bench_multi_gpu.py", "--case", "presharded", "--model", "tiny-gpt", "--budget", "12MiB",
                     "--device", "cpu", "--seq", "32", "--global-batch-size", "4", "--rung-steps", "1",
                     "--optimizer-form", "fused")
    assert out["plan"] is not None and out["arithmetic_floor_bytes"] == 16 * out["parameters"] / 2
    outcomes = {r["rung"]: r["outcome"] for r in out["rungs"]}
    assert set(outcomes.values()) <= {"ok", "oom"}, [r.get("traceback") for r in out["rungs"]]
    assert all(r["simulated_peak"] > 0 for r in out["rungs"] if r["outcome"] == "ok")


def test_the_peak_breakdown_replays_the_allocators_trace_to_its_highest_point():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from peak_breakdown import OTHER, at_peak

    def frames(filename: str, name: str) -> list[dict]:
        return [{"filename": filename, "name": name, "line": 1}]

    gather = frames("torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "foreach_all_gather")
    adam = frames("/site-packages/torch/optim/adam.py", "_multi_tensor_adam")
    forward = frames("model.py", "forward")
    trace = [{"action": "segment_alloc", "addr": 0, "size": 4096},
             {"action": "alloc", "addr": 1, "size": 300, "frames": forward},
             {"action": "alloc", "addr": 2, "size": 200, "frames": gather},
             {"action": "free_requested", "addr": 2, "size": 200},
             {"action": "free_completed", "addr": 2, "size": 200},
             {"action": "oom", "size": 4096, "device_free": 0},  # a mark with no block of its own
             {"action": "alloc", "addr": 3, "size": 900, "frames": adam},  # the highest point: 1000 + 300 + 900
             {"action": "free_completed", "addr": 3, "size": 900},
             {"action": "free_completed", "addr": 1, "size": 300},
             {"action": "alloc", "addr": 4, "size": 1000, "frames": gather}]  # 2000 later: under the peak
    found = at_peak({"device_traces": [trace]}, before=1000)
    assert found["peak_allocated"] == 2200
    assert found["by_owner"] == {"before the steps": 1000, OTHER: 300, "optimizer step": 900}
    assert found["segments_added_by_peak"] == 4096
