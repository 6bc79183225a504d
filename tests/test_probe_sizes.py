"""The size a rung is probed at after its first trial is balanced: a micro-batch that needs as many micro-steps
as a smaller one is charged for samples the smaller one would not run, so it scores the rung below its speed."""

from __future__ import annotations

from test_lattice import ANCHORS, GiB, LatticeGPU, N, _search

from autotune.search.explore import balanced_probe
from autotune.search.ledger import Ledger
from autotune.workload.batching import solve_accumulation


def _ledger(per_rank: int, sizes: list[int] | None = None) -> Ledger:
    return Ledger(runner=lambda rung, micro: None, per_rank=per_rank, limit=1, cap=per_rank,  # type: ignore
                  max_trials=24, sizes=sizes)


def test_the_probe_is_the_largest_balanced_size_up_to_the_one_asked_for():
    s = _ledger(64)
    assert balanced_probe(s, 10, 20) == 16  # 20 of 64 is four micro-steps, as 16 is
    assert balanced_probe(s, 16, 20) == 22  # no balanced size between: the next one above, three micro-steps
    assert balanced_probe(s, 4, 8) == 8
    assert balanced_probe(_ledger(64, [1, 2, 4, 8, 16, 32, 64]), 16, 20) == 32


def test_no_rung_is_probed_at_an_unbalanced_micro_batch():
    # Optimizer offload without recompute reaches 10 of 64; every block recomputed starts there and probes
    # twice as many, 20, which would take four micro-steps of 20 where 16 takes four of 16.
    gpu = LatticeGPU(budget=24 * GiB, per_rank=64, floors={"none": 4 * GiB, "activations": 4 * GiB,
                                                          "optimizer": 2 * GiB}, s0=1.9 * GiB, sn=0.6 * GiB)
    _search(gpu)
    recompute = [m for r, m in gpu.calls if r.checkpointed_blocks == N and r in ANCHORS]
    assert recompute, gpu.calls
    for m in recompute:
        steps, _ = solve_accumulation(64, m)
        assert m == -(-64 // steps), (m, gpu.calls)
