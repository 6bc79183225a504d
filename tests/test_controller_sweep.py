"""The search over thousands of random workloads against the scripted fake runners, anchors alone and with the
lattice (blocks recomputed 0..N, compile, which may fail): whatever the memory and time lines, the batch, the cap
(`autotune run`'s retune after an OOM) and the allowed sizes, it ends in a plan or in `NoFeasiblePlan`, never in
another error, never tries a micro-batch over the cap, and picks a trial that fits.
Before its mend the search raised StopIteration wherever a rung fitted at the largest balanced size under the
cap (24 samples capped at 7: every size from 6 to 7 runs four micro-steps); the sweeps met it 7 times in 4,000
and 34 times in 2,000."""

from __future__ import annotations

import random
from typing import Any

from test_controller import BF16, FULL, OFFLOAD, SEL, FakeGPU, GiB
from test_lattice import ANCHORS, LatticeGPU, N

from autotune.configuration import Rung
from autotune.errors import NoFeasiblePlan
from autotune.search.controller import Controller, Lattice

RUNGS = [BF16, SEL, FULL, OFFLOAD, Rung(checkpointing="full", offload="activations")]
BATCHES = [1, 2, 3, 5, 7, 8, 12, 16, 24, 31, 32, 48, 64, 100, 128]
CASES = 4000


def _limits(rng: random.Random, per_rank: int) -> dict[str, Any]:
    """A cap on the micro-batch half the time, `autotune run`'s allowed sizes (the batch's divisors) a third."""
    limits: dict[str, Any] = {}
    if rng.random() < 0.5:
        limits["max_micro"] = rng.randint(1, per_rank)
    if rng.random() < 0.3:
        limits["sizes"] = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    return limits


def _workload(rng: random.Random) -> tuple[int, dict[Rung, tuple[float, ...]], list[Rung], dict[str, Any]]:
    """A batch, each rung's memory line (fixed bytes, bytes per sample) and time line (launch, per sample,
    optimizer), the rungs searched, and the cap and allowed sizes, drawn at random."""
    per_rank = rng.choice(BATCHES)
    fixed, per_sample = rng.uniform(1, 70), rng.uniform(0.05, 20)
    lines = {r: (fixed * rng.uniform(0.3, 1.0) * GiB, per_sample * rng.uniform(0.2, 1.0) * GiB,
                 rng.uniform(0.001, 0.2), rng.uniform(0.001, 0.05), rng.uniform(0.001, 2)) for r in RUNGS}
    searched = rng.sample(RUNGS, rng.randint(1, len(RUNGS)))
    return per_rank, lines, searched, _limits(rng, per_rank)


def _lattice_gpu(rng: random.Random) -> LatticeGPU:
    """test_lattice's scripted GPU with its floors, bytes per sample, times and compile's effects drawn at random."""
    base, s0 = rng.uniform(1, 70) * GiB, rng.uniform(0.05, 20) * GiB
    return LatticeGPU(budget=80 * GiB, per_rank=rng.choice(BATCHES),
                      floors={"none": base, "activations": base, "optimizer": base * rng.uniform(0.2, 0.9)},
                      s0=s0, sn=s0 * rng.uniform(0.05, 0.6), launch=rng.uniform(0.001, 0.2),
                      sample_time=rng.uniform(0.001, 0.05), compile_memory=rng.uniform(0.5, 1.1),
                      compile_floor=rng.uniform(0, 2) * GiB, compile_time=rng.uniform(0.6, 1.2),
                      compile_error=rng.random() < 0.1,
                      optimizer_seconds={"none": 0.05, "activations": 0.05, "optimizer": rng.uniform(0.01, 3)})


def _check(case: int, gpu: FakeGPU | LatticeGPU, limits: dict[str, Any], rungs: list[Rung],
           lattice: Lattice | None = None) -> bool:
    """Search `rungs` (and `lattice`) on `gpu` under `limits`; False for NoFeasiblePlan, else assert the plan fits
    and nothing went over the cap."""
    try:
        result = Controller(gpu, per_rank=gpu.per_rank, limit_bytes=int(0.9 * gpu.budget), **limits).search(
            rungs, lattice)
    except NoFeasiblePlan:
        return False
    cap = limits.get("max_micro", gpu.per_rank)
    tried = [micro for _, micro in gpu.calls]
    assert max(tried) <= cap, (case, gpu.per_rank, limits, tried)
    pick = result.picked()
    assert pick.fits and pick.peak_bytes <= 0.9 * gpu.budget, (case, pick)
    assert pick in result.trials and pick.micro_batch_size <= cap, (case, pick.micro_batch_size, cap)
    return True


def test_the_search_ends_in_a_fitting_plan_under_the_cap_or_in_no_feasible_plan_on_any_workload():
    rng = random.Random(0)
    plans = 0
    for case in range(CASES):
        per_rank, lines, searched, limits = _workload(rng)
        plans += _check(case, FakeGPU(80 * GiB, per_rank, lines), limits, searched)
    assert plans > CASES // 2  # most workloads fit: the sweep checks plans, not only refusals


def test_the_lattice_search_ends_in_a_fitting_plan_under_the_cap_or_in_no_feasible_plan_on_any_workload():
    rng = random.Random(1)
    plans = 0
    for case in range(CASES // 2):
        gpu = _lattice_gpu(rng)
        limits = _limits(rng, gpu.per_rank)
        anchors = [a for a in ANCHORS if rng.random() < 0.8] or ANCHORS[:1]
        plans += _check(case, gpu, limits, anchors, Lattice(blocks=N, compile=rng.random() < 0.7))
    assert plans > CASES // 4
