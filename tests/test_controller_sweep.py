"""The search over thousands of random workloads against the scripted fake runner: whatever the memory and time
lines, the batch, the cap (`autotune run`'s retune after an OOM) and the allowed sizes, it ends in a plan or in
`NoFeasiblePlan`, never in another error, never tries a micro-batch over the cap, and picks a trial that fits.
Before its mend the search raised StopIteration wherever a rung fitted at the largest balanced size under the cap
(24 samples capped at 7: every size from 6 to 7 runs four micro-steps); this sweep met it 7 times in 4,000."""

from __future__ import annotations

import random

from test_controller import BF16, FULL, OFFLOAD, SEL, FakeGPU, GiB

from autotune.configuration import Rung
from autotune.errors import NoFeasiblePlan
from autotune.search.controller import Controller

RUNGS = [BF16, SEL, FULL, OFFLOAD, Rung(checkpointing="full", offload="activations")]
BATCHES = [1, 2, 3, 5, 7, 8, 12, 16, 24, 31, 32, 48, 64, 100, 128]
CASES = 4000


def _workload(rng: random.Random) -> tuple[int, dict[Rung, tuple[float, ...]], list[Rung], dict[str, object]]:
    """A batch, each rung's memory line (fixed bytes, bytes per sample) and time line (launch, per sample,
    optimizer), the rungs searched, and the cap and allowed sizes, drawn at random."""
    per_rank = rng.choice(BATCHES)
    fixed, per_sample = rng.uniform(1, 70), rng.uniform(0.05, 20)
    lines = {r: (fixed * rng.uniform(0.3, 1.0) * GiB, per_sample * rng.uniform(0.2, 1.0) * GiB,
                 rng.uniform(0.001, 0.2), rng.uniform(0.001, 0.05), rng.uniform(0.001, 2)) for r in RUNGS}
    searched = rng.sample(RUNGS, rng.randint(1, len(RUNGS)))
    limits: dict[str, object] = {}
    if rng.random() < 0.5:
        limits["max_micro"] = rng.randint(1, per_rank)
    if rng.random() < 0.3:  # `autotune run`'s sizes: the divisors of the batch
        limits["sizes"] = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    return per_rank, lines, searched, limits


def test_the_search_ends_in_a_fitting_plan_under_the_cap_or_in_no_feasible_plan_on_any_workload():
    rng = random.Random(0)
    plans = 0
    for case in range(CASES):
        per_rank, lines, searched, limits = _workload(rng)
        gpu = FakeGPU(80 * GiB, per_rank, lines)
        try:
            result = Controller(gpu, per_rank=per_rank, limit_bytes=int(0.9 * gpu.budget), **limits).search(searched)
        except NoFeasiblePlan:
            continue
        cap = limits.get("max_micro", per_rank)
        tried = [micro for _, micro in gpu.calls]
        assert max(tried) <= cap, (case, per_rank, limits, tried)
        pick = result.picked()
        assert pick.fits and pick.peak_bytes <= 0.9 * gpu.budget, (case, pick)
        assert pick in result.trials and pick.micro_batch_size <= cap, (case, pick.micro_batch_size, cap)
        plans += 1
    assert plans > CASES // 2  # most workloads fit: the sweep checks plans, not only refusals
