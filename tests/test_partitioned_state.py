"""The optimizer state partitioned over replicated ranks, priced after the pick (search/partitioned_state.py),
against the scripted lattice GPU of test_lattice.py: the pick's configuration partitioned frees what it
measures, and the search's lines (`placement.with_room`) say what that room lets fit."""

from __future__ import annotations

import dataclasses

import pytest
from test_lattice import ANCHORS, GiB, LatticeGPU, N

from autotune.configuration import Rung
from autotune.evidence import Trial
from autotune.search import partitioned_state
from autotune.search.controller import Controller, Lattice
from autotune.search.ledger import Ledger
from autotune.search.placement import with_room


def _gpu() -> LatticeGPU:
    # GPT-2 medium's shape at 16 GiB on one of two ranks: 32 samples a rank, the replicated floor 8 GiB, a
    # sample 0.6 GiB with no block recomputed: all 32 fit only with every block recomputed (0.15 GiB a
    # sample), which beats fewer blocks at two micro-steps of 16; 2.5 GiB more room fits 32 with 3 of 4.
    return LatticeGPU(budget=16 * GiB, per_rank=32, floors={"none": 8 * GiB, "activations": 8 * GiB,
                                                           "optimizer": 3 * GiB}, s0=0.6 * GiB, sn=0.15 * GiB,
                      launch=0.2, sample_time=0.02, optimizer_seconds={"none": 0.02, "activations": 0.02,
                                                                       "optimizer": 0.5})


def _searched(gpu: LatticeGPU) -> Ledger:
    limit = int(0.9 * gpu.budget)
    controller = Controller(gpu, per_rank=gpu.per_rank, limit_bytes=limit)  # rates per rank, as the GPU's
    anchors = [r for r in ANCHORS if r.offload != "activations"]  # free in this GPU's time model: it would win
    floors = {r: int(gpu.floors[r.offload]) for r in anchors}
    return controller.search(anchors, Lattice(blocks=N, floors=floors))


def _partitioned_run(gpu: LatticeGPU, freed: float, *, needs_blocks: int = 0, pick_again: float = 1.0):
    """Runs a rung partitioned as the GPU runs it with `freed` off its floor; a configuration with fewer than
    `needs_blocks` blocks recomputed runs out of memory (what a miss looks like). The pick's own rung, measured
    again as long and not partitioned, at `pick_again` times its first speed."""
    ran: list[tuple[Rung, int, str]] = []

    def run(rung: Rung, micro: int, sharding: str) -> Trial:
        ran.append((rung, micro, sharding))
        if sharding == "none":
            trial = gpu(rung, micro)
            return dataclasses.replace(trial, samples_per_second=trial.samples_per_second * pick_again)
        if (rung.checkpointed_blocks or 0) < needs_blocks:
            return Trial(rung=rung, micro_batch_size=micro, outcome="oom", peak_bytes=gpu.budget, sharding=sharding)
        saved = dict(gpu.floors)
        gpu.floors["none"] -= freed
        try:
            trial = gpu(rung, micro)
        finally:
            gpu.floors = saved
        return dataclasses.replace(trial, sharding=sharding)

    return run, ran


def test_the_room_partitioning_frees_buys_fewer_recomputed_blocks():
    gpu = _gpu()
    result = _searched(gpu)
    pick = result.picked()
    assert pick.rung.offload == "none" and pick.rung.checkpointed_blocks, pick  # the scenario: recompute
    run, ran = _partitioned_run(gpu, 2.5 * GiB)
    winner, judged = partitioned_state.price(result, pick, run, 2)
    assert ran[0] == (pick.rung, pick.micro_batch_size, "optimizer_state")  # measures what it frees
    assert winner is not None and winner.sharding == "optimizer_state" and winner.rung.offload == "none"
    assert winner.fits
    assert (winner.rung.checkpointed_blocks < pick.rung.checkpointed_blocks
            or winner.micro_batch_size > pick.micro_batch_size)
    assert winner.samples_per_second > 1.03 * judged.samples_per_second
    # judged against the pick measured again, as long as the partitioned trials
    assert ran[-1] == (pick.rung, pick.micro_batch_size, "none")
    assert len(ran) <= 2 + partitioned_state.TRIES
    assert winner in result.trials and judged in result.trials
    assert result.notes[-1].endswith("kept")
    assert "1.05x" in partitioned_state.reason(winner, judged, 2, "then")


def test_a_lead_that_the_pick_measured_again_erases_leaves_the_pick():
    gpu = _gpu()
    result = _searched(gpu)
    pick = result.picked()
    run, ran = _partitioned_run(gpu, 2.5 * GiB, pick_again=1.04)  # the pick's first trial read 4% low
    winner, judged = partitioned_state.price(result, pick, run, 2)
    assert winner is None and judged.samples_per_second == pytest.approx(1.04 * pick.samples_per_second)
    assert ran[-1] == (pick.rung, pick.micro_batch_size, "none") and "not faster than the pick" in result.notes[-1]


def test_without_room_freed_no_other_configuration_is_tried_and_the_pick_stays():
    gpu = _gpu()
    result = _searched(gpu)
    pick = result.picked()
    run, ran = _partitioned_run(gpu, -0.1 * GiB)  # partitioned peaks higher: nothing freed
    winner, judged = partitioned_state.price(result, pick, run, 2)
    assert winner is None and judged == pick
    # no other configuration tried: the same one partitioned, then the pick again beside it
    assert ran == [(pick.rung, pick.micro_batch_size, "optimizer_state"), (pick.rung, pick.micro_batch_size, "none")]
    assert "not faster than the pick" in result.notes[-1]


def test_a_miss_is_not_followed_by_what_it_rules_out_and_leaves_the_pick():
    gpu = _gpu()
    result = _searched(gpu)
    pick = result.picked()
    predicted = with_room(result, pick.rung, 2.5 * GiB)
    assert predicted and predicted[0][0].checkpointed_blocks < pick.rung.checkpointed_blocks
    first_blocks, first_micro = predicted[0][0].checkpointed_blocks, predicted[0][1]
    run, ran = _partitioned_run(gpu, 2.5 * GiB, needs_blocks=first_blocks + 1)  # the predicted one runs out
    assert partitioned_state.price(result, pick, run, 2)[0] is None
    assert ran[1] == (predicted[0][0], first_micro, "optimizer_state")
    # nothing with no more blocks at as many samples after the miss
    assert not [(r, m) for r, m, _ in ran[2:] if r.checkpointed_blocks <= first_blocks and m >= first_micro]
    assert "oom" in result.notes[-1] and "not faster than the pick" in result.notes[-1]


@pytest.mark.parametrize("change,expected", [
    ({}, True),
    ({"world": 1}, False),
    ({"sharded": True}, False),
    ({"state_tensors": 0}, False),  # SGD without momentum: no state to partition
    ({"allowed": frozenset({"bf16", "checkpointing"})}, False),
    ({"rung": Rung(offload="optimizer")}, False),  # the pick offloads already (its share was chosen)
    ({"rung": Rung(precision="fp16")}, False),  # a GradScaler's inf check would need every rank's gradients
])
def test_who_is_eligible(change, expected, monkeypatch):
    monkeypatch.delenv("AUTOTUNE_OFFLOAD_PARTITION", raising=False)
    args = {"world": 2, "sharded": False, "state_tensors": 2, "allowed": frozenset({"bf16", "offload"}),
            "rung": Rung(checkpointing="selective", checkpointed_blocks=3), **change}
    best = Trial(rung=args.pop("rung"), micro_batch_size=4, outcome="ok")
    assert partitioned_state.eligible(best, **args) is expected
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_PARTITION", "0")
    assert not partitioned_state.eligible(best, **args)
