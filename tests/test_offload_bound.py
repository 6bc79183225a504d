"""An offloading configuration is not run, or not grown, where its base (the same configuration with nothing
offloaded) has measured a time line that bounds it below what the base already reached: offloading only adds
to a step, so its one gain, a larger micro-batch, must pay for the copies. Against the scripted GPU of
test_lattice.py, whose offloads cost what they do on a GPU: activation copies a little per sample."""

from __future__ import annotations

import dataclasses

from test_lattice import ANCHORS, GiB, LatticeGPU, N, _rung, assert_near_the_best_reachable

from autotune.configuration import Rung
from autotune.evidence import Trial
from autotune.search.controller import Controller, Lattice


@dataclasses.dataclass
class CopyingGPU(LatticeGPU):
    """The lattice GPU with activation offload's copies in the step: `copy_time` seconds per sample."""

    copy_time: float = 0.0

    def __call__(self, rung: Rung, micro: int) -> Trial:
        trial = super().__call__(rung, micro)
        if rung.offload != "activations" or trial.step_seconds <= 0:
            return trial
        step = trial.step_seconds + micro * self.copy_time
        total = -(-self.per_rank // micro) * step + trial.optimizer_seconds
        return dataclasses.replace(trial, step_seconds=step, samples_per_second=self.per_rank / total)


def _search(gpu: LatticeGPU, *, compile: bool) -> tuple[Trial, list[str], Controller]:
    limit = int(0.9 * gpu.budget)
    floors = {r: int(gpu.floors[r.offload]) for r in ANCHORS}
    controller = Controller(gpu, per_rank=gpu.per_rank, limit_bytes=limit)
    result = controller.search(ANCHORS, Lattice(blocks=N, compile=compile, floors=floors))
    return result.picked(), result.notes, controller


def _sizes(gpu: LatticeGPU, rung: Rung) -> list[int]:
    return sorted(m for r, m in gpu.calls if r == rung)


def test_activation_offload_is_not_grown_past_a_first_trial_its_copies_already_lose():
    # Every block recomputed fits 16 samples of the 64; activation offload fits the whole batch, but its copies
    # cost 0.06 s a sample: at 16 it ran slower than its base, and by the base's slope it stays slower at 64.
    gpu = CopyingGPU(budget=24 * GiB, per_rank=64, floors={"none": 4 * GiB, "activations": 4 * GiB,
                                                          "optimizer": 2 * GiB},
                     s0=8 * GiB, sn=1 * GiB, launch=0.3, copy_time=0.06)
    best, notes, controller = _search(gpu, compile=False)
    assert _sizes(gpu, _rung(N, "activations")) == [16]
    assert any(n.startswith(f"{_rung(N, 'activations').name} not grown: past micro-batch 16") for n in notes)
    assert best.rung == _rung(N) and best.micro_batch_size == 16
    assert_near_the_best_reachable(gpu, best, controller)


def test_an_offload_anchor_its_base_bounds_below_what_the_base_ran_is_not_tried_even_beside_a_faster_compile():
    # The whole batch of 16 fits with every block recomputed, so offloading can grow no micro-batch: neither
    # recompute anchor with an offload can beat its base. Compile without recompute measured fastest first,
    # and its time line, extrapolated, does not rule them out; their base's line does.
    gpu = CopyingGPU(budget=24 * GiB, per_rank=16, floors={"none": 4 * GiB, "activations": 4 * GiB,
                                                          "optimizer": 2 * GiB},
                     s0=4 * GiB, sn=1 * GiB, launch=0.02, compile_time=0.5, copy_time=0.005)
    best, notes, controller = _search(gpu, compile=True)
    for offload in ("activations", "optimizer"):
        assert _sizes(gpu, _rung(N, offload)) == [], offload
        assert any(n.startswith(f"{_rung(N, offload).name} not tried: at any micro-batch") for n in notes)
    assert best.rung.compile
    assert_near_the_best_reachable(gpu, best, controller)


def test_an_offload_that_lets_the_micro_batch_grow_enough_to_win_is_still_grown_and_picked():
    # Each micro-step has a large fixed cost: every block recomputed fits 4 samples of 16, and activation
    # offload, at its base's speed there, fits 8: its base's line leaves it room to win, and it does.
    gpu = CopyingGPU(budget=24 * GiB, per_rank=16, floors={"none": 14 * GiB, "activations": 14 * GiB,
                                                          "optimizer": 4 * GiB},
                     s0=3 * GiB, sn=2 * GiB, launch=1.0, optimizer_seconds={"none": 0.05, "activations": 0.05,
                                                                              "optimizer": 0.2})
    best, notes, controller = _search(gpu, compile=False)
    assert _sizes(gpu, _rung(N))[-1] == 4 and len(_sizes(gpu, _rung(N, "activations"))) >= 2
    assert best.rung.offload != "none" and best.micro_batch_size >= 8
    assert not any(" not tried: " in n or " not grown: " in n for n in notes)
    assert_near_the_best_reachable(gpu, best, controller)


def test_an_offload_whose_bound_with_its_least_copy_cost_is_not_above_its_base_is_not_tried():
    # Activation offload's copies cost little (0.003 s a sample): grown to the whole batch of 64 at its base's speed
    # it would reach 25.6 samples/s beside its base's 24.9 at 16, but each micro-step also pays at least the
    # copies' least cost (15%), which leaves it below its base: it is not run. A compiled configuration leads, so
    # the bound from the best trial's own time line does not rule it out.
    gpu = CopyingGPU(budget=24 * GiB, per_rank=64, floors={"none": 4 * GiB, "activations": 4 * GiB,
                                                          "optimizer": 2 * GiB},
                     s0=2 * GiB, sn=1 * GiB, launch=0.04, sample_time=0.0277, copy_time=0.003, compile_time=0.5)
    best, notes, controller = _search(gpu, compile=True)
    assert _sizes(gpu, _rung(N, "activations")) == []
    said = [n for n in notes if n.startswith(f"{_rung(N, 'activations').name} not tried: at any micro-batch at most")]
    assert said and float(said[0].split("at most ")[1].split(" ")[0]) < 24.9, notes
    assert _sizes(gpu, _rung(N, "optimizer")), "optimizer offload pays no copy cost per micro-step: still bounded alike"
    assert best.rung.compile
    assert_near_the_best_reachable(gpu, best, controller)
