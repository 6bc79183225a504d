"""The lattice search against a scripted GPU whose memory and time follow each knob: blocks
recomputed (0..N), offload none / activations / optimizer, compile off / on. No model, no device: what the
controller tries and what it picks, deterministically."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from autotune.configuration import Rung
from autotune.evidence import Trial
from autotune.search.controller import Controller, Lattice
from autotune.techniques.offload import HostOptimizer
from autotune.workload.batching import global_step_seconds

GiB = 2**30
N = 4  # repeated blocks


def _rung(k: int, offload: str = "none", compiled: bool = False) -> Rung:
    label = "none" if k == 0 else "full" if k == N else "selective"
    return Rung(checkpointing=label, checkpointed_blocks=k, offload=offload, compile=compiled)


# The anchors as `search.anchors.anchors` orders them for N blocks with every technique allowed.
ANCHORS = [_rung(0), _rung(N), _rung(0, "optimizer"), _rung(N, "activations"), _rung(N, "optimizer")]


@dataclasses.dataclass
class LatticeGPU:
    """peak = floor[offload] + m x bytes/sample(k, compile); micro-step = launch + m x t x recompute x compile."""

    budget: int
    per_rank: int
    floors: dict[str, float]
    s0: float  # bytes per sample with no block recomputed
    sn: float  # with every block recomputed
    launch: float = 0.1
    sample_time: float = 0.05
    compile_memory: float = 1.0
    compile_floor: float = 0.0  # what compiled code adds to the floor (workspaces)
    compile_time: float = 1.0
    compile_launch: float | None = None  # a compiled micro-step's fixed cost, where it is not launch x compile_time
    compile_error: bool = False
    optimizer_seconds: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"none": 0.05, "activations": 0.05, "optimizer": 0.4})

    def __post_init__(self) -> None:
        self.calls: list[tuple[Rung, int]] = []

    def __call__(self, rung: Rung, micro: int) -> Trial:
        self.calls.append((rung, micro))
        if rung.compile and self.compile_error:
            return Trial(rung=rung, micro_batch_size=micro, outcome="error", note="BackendCompilerFailed: test")
        frac = (rung.checkpointed_blocks or 0) / N
        keep = self.s0 * (1 - frac) * (self.compile_memory if rung.compile else 1.0)
        per_sample = keep + self.sn * frac * (0.3 if rung.offload == "activations" else 1.0)
        peak = int(self.floors[rung.offload] + (self.compile_floor if rung.compile else 0) + micro * per_sample)
        if peak > self.budget:
            return Trial(rung=rung, micro_batch_size=micro, outcome="oom", peak_bytes=self.budget)
        step = (self.launch + micro * self.sample_time * (1 + 0.33 * frac)) * (self.compile_time if rung.compile else 1)
        if rung.compile and self.compile_launch is not None:
            step += self.compile_launch - self.launch * self.compile_time
        opt = self.optimizer_seconds[rung.offload]
        rate = self.per_rank / global_step_seconds(step, opt, self.per_rank, micro)
        outcome = "ok" if peak <= 0.9 * self.budget else "over_budget"
        return Trial(rung=rung, micro_batch_size=micro, outcome=outcome, peak_bytes=peak, step_seconds=step,
                     optimizer_seconds=opt, samples_per_second=rate)

    def best_rate(self, rungs: list[Rung]) -> float:
        """The fastest fitting configuration over `rungs` x every micro-batch, by brute force."""
        saved = list(self.calls)
        rates = [t.samples_per_second for r in rungs for m in range(1, self.per_rank + 1)
                 if (t := self(r, m)).outcome == "ok"]
        self.calls = saved
        return max(rates)


def _search(gpu: LatticeGPU, *, compile: bool = False,
            fitting_floors: bool = False) -> tuple[Trial, list[str], Controller]:
    """The lattice search over the anchors; `fitting_floors` leaves out those whose floor is over the limit,
    as fit does before searching (`drop_rungs_over`)."""
    limit = int(0.9 * gpu.budget)
    anchors = [r for r in ANCHORS if not fitting_floors or gpu.floors[r.offload] < limit]
    floors = {r: int(gpu.floors[r.offload]) for r in anchors}
    controller = Controller(gpu, per_rank=gpu.per_rank, limit_bytes=limit)
    result = controller.search(anchors, Lattice(blocks=N, compile=compile, floors=floors))
    return result.picked(), result.notes, controller


def assert_near_the_best_reachable(gpu: LatticeGPU, best: Trial, controller: Controller) -> None:
    """Within 3% of the fastest configuration over every knob, compile with recompute included, with at most
    3 OOMs on the way."""
    assert best.samples_per_second >= 0.97 * gpu.best_rate(_every(compiled=True))
    assert sum(t.outcome == "oom" for t in controller.trials) <= 3


def _every(compiled: bool = False) -> list[Rung]:
    return [_rung(k, o, c) for k in range(N + 1) for o in ("none", "optimizer")
            for c in ((False, True) if compiled else (False,))]


def test_when_the_optimizer_state_is_what_does_not_fit_offload_it_and_recompute_nothing():
    # FP32 weights, gradients and AdamW state (30 GiB) are over the 21.6 GiB limit; under optimizer offload
    # 4 GiB stay, and the whole per-rank batch fits without recomputing a block.
    gpu = LatticeGPU(budget=24 * GiB, per_rank=16, floors={"none": 30 * GiB, "activations": 30 * GiB,
                                                          "optimizer": 4 * GiB}, s0=1 * GiB, sn=0.3 * GiB)
    best, _, _ = _search(gpu)
    assert best.rung.offload == "optimizer"
    assert best.rung.checkpointed_blocks == 0 and best.rung.checkpointing == "none"
    assert best.micro_batch_size == 16


def test_when_some_blocks_suffice_only_those_are_recomputed():
    # No recompute fits 8 samples (two micro-steps), all four blocks fit 16 at a third more time per sample;
    # three blocks fit 16 too, for less recompute: the fastest configuration of all, and on no anchor.
    gpu = LatticeGPU(budget=24 * GiB, per_rank=16, floors={"none": 4 * GiB, "activations": 4 * GiB,
                                                          "optimizer": 2 * GiB}, s0=2 * GiB, sn=0.5 * GiB,
                     launch=0.4)
    best, _, controller = _search(gpu)
    assert 0 < best.rung.checkpointed_blocks < N
    assert best.rung.checkpointing == "selective"
    assert best.samples_per_second >= 0.97 * gpu.best_rate(_every())
    assert len(controller.trials) <= 16


def test_compile_is_placed_where_it_lets_the_micro_batch_grow():
    # Compile halves the bytes per sample and the time, at a larger floor (what the H100 showed for GPT-2
    # large); measured once beside the fastest eager configuration, then grown along its own line.
    gpu = LatticeGPU(budget=24 * GiB, per_rank=32, floors={"none": 4 * GiB, "activations": 4 * GiB,
                                                          "optimizer": 2 * GiB}, s0=2 * GiB, sn=0.6 * GiB,
                     compile_memory=0.5, compile_floor=1.5 * GiB, compile_time=0.5)
    best, _, controller = _search(gpu, compile=True)
    assert best.rung.compile and best.rung.checkpointed_blocks == 0
    assert best.samples_per_second >= 0.97 * gpu.best_rate(_every(compiled=True))
    # Every compiled trial keeps the probe's offload.
    compiled = [r for r, _ in gpu.calls if r.compile]
    assert compiled and len({r.offload for r in compiled}) == 1
    assert sum(t.outcome == "oom" for t in controller.trials) <= 3


def test_compile_grows_along_its_own_line_when_the_eager_one_is_unknown():
    # GPT-2 XL at 16 GiB (H100, RESULTS.md): eager optimizer offload fits one sample and runs out of memory at
    # two, so no eager line predicts where compile fits; compile at one sample fitted with room, was slower
    # than full recompute at 8, and was never grown. Launch-bound small steps: two compiled samples a step win.
    gpu = LatticeGPU(budget=16 * GiB, per_rank=64, floors={"none": 23 * GiB, "activations": 23 * GiB,
                                                          "optimizer": 6 * GiB}, s0=8 * GiB, sn=1 * GiB,
                     compile_memory=0.35, compile_floor=1.5 * GiB, compile_time=0.6)
    best, _, controller = _search(gpu, compile=True, fitting_floors=True)
    assert best.rung.compile and best.micro_batch_size >= 2, (best, gpu.calls)
    assert_near_the_best_reachable(gpu, best, controller)


def test_compile_with_every_block_recomputed_is_placed_where_its_larger_micro_batch_wins():
    # W2, GPT-2 XL at 16 GiB on an H100, as fit measured it (RESULTS.md, 2026-11-27): eager fits one sample
    # under optimizer offload, compile two, and at those sizes a micro-step is mostly its fixed cost, which
    # compile does not cut (compile was 1.08x slower than eager at one sample); every block recomputed fits 8.
    # Compiled with recompute, the per-sample work shrinks and 8 micro-steps replace 32: 24,945 against
    # 17,478 tok/s measured. Compile's ratio at one sample would have predicted no gain.
    gpu = LatticeGPU(budget=16 * GiB, per_rank=64, floors={"none": 23 * GiB, "activations": 23 * GiB,
                                                          "optimizer": 6.5 * GiB}, s0=7.6 * GiB, sn=0.85 * GiB,
                     compile_memory=0.42, compile_floor=0.7 * GiB, launch=0.096, sample_time=0.036,
                     compile_time=0.55, compile_launch=0.12,
                     optimizer_seconds={"none": 0.05, "activations": 0.05, "optimizer": 0.7})
    eager1, compiled1 = gpu(_rung(0, "optimizer"), 1), gpu(_rung(0, "optimizer", True), 1)
    assert compiled1.samples_per_second < eager1.samples_per_second  # compile loses at one sample
    gpu.calls.clear()
    best, notes, controller = _search(gpu, compile=True, fitting_floors=True)
    assert best.rung.compile and best.rung.checkpointed_blocks and best.micro_batch_size >= 6, (best, notes)
    assert_near_the_best_reachable(gpu, best, controller)
    assert len(controller.trials) <= 14


def test_compile_with_recompute_is_not_tried_where_no_recompute_already_fits_the_whole_batch():
    gpu = LatticeGPU(budget=24 * GiB, per_rank=16, floors={"none": 4 * GiB, "activations": 4 * GiB,
                                                          "optimizer": 2 * GiB}, s0=1 * GiB, sn=0.3 * GiB,
                     compile_memory=0.5, compile_time=0.5)
    best, _, _ = _search(gpu, compile=True)
    assert best.rung.compile and best.rung.checkpointed_blocks == 0 and best.micro_batch_size == 16
    assert not any(r.compile and r.checkpointed_blocks for r, _ in gpu.calls)


def test_compile_is_tried_with_the_other_offload_when_its_savings_predict_a_win():
    # Two H100s, GPT-2 medium, 16 GiB and 32 samples per rank: eager optimizer offload led (its host step is
    # paid once for 4 samples a micro-batch, against 2 without offload), so compile went there only, while
    # compiled without offload 4 samples fit and the cheap device optimizer wins (the 1.885x plan on two H200s).
    # (Activation offload is kept out of the race: the scripted GPU charges its copies no time.)
    gpu = LatticeGPU(budget=16 * GiB, per_rank=32, floors={"none": 7.5 * GiB, "activations": 13.5 * GiB,
                                                          "optimizer": 2.7 * GiB}, s0=2.75 * GiB, sn=1.5 * GiB,
                     launch=0.06, sample_time=0.0035, compile_memory=0.55, compile_time=0.6,
                     optimizer_seconds={"none": 0.06, "activations": 0.06, "optimizer": 0.45})
    eager_none, eager_offload = gpu(_rung(0), 2), gpu(_rung(0, "optimizer"), 4)
    assert eager_offload.samples_per_second > eager_none.samples_per_second  # the eager leader is offload's
    gpu.calls.clear()
    best, _, controller = _search(gpu, compile=True)
    assert best.rung.compile and best.rung.offload == "none" and best.rung.checkpointed_blocks == 0, best
    assert_near_the_best_reachable(gpu, best, controller)


def test_a_compile_failure_leaves_the_plan_eager_with_a_note():
    gpu = LatticeGPU(budget=24 * GiB, per_rank=32, floors={"none": 4 * GiB, "activations": 4 * GiB,
                                                          "optimizer": 2 * GiB}, s0=2 * GiB, sn=0.6 * GiB,
                     compile_error=True)
    best, notes, _ = _search(gpu, compile=True)
    assert not best.rung.compile
    assert any(n.startswith("compile failed (BackendCompilerFailed") for n in notes)
    assert sum(r.compile for r, _ in gpu.calls) == 1  # tried once, never again


def test_compile_is_not_tried_when_the_lattice_forbids_it():
    gpu = LatticeGPU(budget=24 * GiB, per_rank=32, floors={"none": 4 * GiB, "activations": 4 * GiB,
                                                          "optimizer": 2 * GiB}, s0=2 * GiB, sn=0.6 * GiB,
                     compile_memory=0.5, compile_time=0.5)
    best, _, _ = _search(gpu, compile=False)
    assert not best.rung.compile
    assert not any(r.compile for r, _ in gpu.calls)


# -- plan.apply reproduces each knob (a real model on the CPU, float64) -----------------------------------

from test_step import (  # noqa: E402
    assert_same_training,
    make_plan,
    new_model,
    padded_batch,
    peak_of,
    run_plan,
    run_reference,
    seq_batch,
    token_loss,
)


def _with_blocks(plan, k: int, offload: str = "none"):
    label = "none" if k == 0 else "full" if k == N else "selective"
    fraction = 1.0 if offload == "optimizer" else 0.0
    return plan.with_config(checkpointing=label, checkpointed_blocks=k, offload=offload,
                               offload_fraction=fraction)


def test_apply_recomputes_exactly_the_planned_number_of_blocks_and_stays_exact():
    model = new_model()  # four repeated blocks
    batch = seq_batch(6, 5, seed=3)
    want, _ = run_reference(model, [batch])
    for k in range(N + 1):
        plan = _with_blocks(make_plan(4, 6), k)
        wrapped: list[int] = []

        def count(step, wrapped=wrapped):  # the blocks whose forward is wrapped while the step is in force
            wrapped.append(sum("forward" in b.__dict__ for b in step.model.blocks))

        got, step, _ = run_plan(plan, model, [batch], before_optimizer_step=count)
        assert wrapped == [k], f"plan with {k} blocks recomputed wrapped {wrapped}"
        assert step.plan.checkpointed_blocks == k
        assert_same_training(model, got, want)
        step.close()
        assert not any("forward" in b.__dict__ for b in got.blocks)  # close() undoes every knob


def test_recovery_keeps_exact_gradients_with_some_blocks_recomputed():
    # As test_step's mid-batch recovery, on a plan with 2 of 4 blocks recomputed: the retry at a smaller
    # micro-batch (or with more blocks recomputed) loses no sample and counts none twice.
    model = new_model()
    batch = padded_batch([8, 5, 8, 3, 64, 40, 64, 7], t=64)
    plan4, plan2 = (_with_blocks(make_plan(m, 8), 2) for m in (4, 2))
    budget = (peak_of(plan4, model, batch, loss_fn=token_loss) + peak_of(plan2, model, batch, loss_fn=token_loss)) // 2
    plan = _with_blocks(make_plan(4, 8, budget=budget), 2)
    got, step, losses = run_plan(plan, model, [batch], loss_fn=token_loss)
    want, want_losses = run_reference(model, [batch], loss_fn=token_loss)
    assert step.recoveries, "the longer micro-batch should not fit the budget made for the short ones"
    now = step.plan
    assert (now.micro_batch_size, now.checkpointed_blocks) != (4, 2)
    assert now.checkpointed_blocks >= 2  # recovery never recomputes fewer blocks than the plan did
    assert_same_training(model, got, want)
    assert losses[0] == pytest.approx(want_losses[0], rel=1e-10)


def test_optimizer_offload_without_recompute_is_applied_as_planned():
    model = new_model(dtype=torch.float32)
    plan = _with_blocks(make_plan(4, 8, precision="bf16"), 0, offload="optimizer")
    seen: list[tuple[bool, int]] = []

    def look(step):
        wrapped = sum("forward" in b.__dict__ for b in step.model.blocks)
        seen.append((isinstance(step.optimizer, HostOptimizer), wrapped))

    got, step, losses = run_plan(plan, model, [seq_batch(8, 5, seed=4, dtype=torch.float32)] * 2,
                                 before_optimizer_step=look)
    assert seen and all(offloaded and wrapped == 0 for offloaded, wrapped in seen), seen
    assert all(math.isfinite(x) for x in losses) and losses[1] < losses[0]
    step.close()
    assert all(p.dtype == torch.float32 for p in got.parameters())


def test_compile_with_recompute_is_tried_where_nothing_fits_without_recompute():
    # A 3B decoder at 24 GiB: under optimizer offload the 16-bit weights and gradients leave room for no
    # sample without recompute, every block recomputed fits two; compile was never probed without recompute,
    # and is still tried with it, and wins.
    gpu = LatticeGPU(budget=24 * GiB, per_rank=32, floors={"none": 60 * GiB, "activations": 60 * GiB,
                                                          "optimizer": 14 * GiB}, s0=9 * GiB, sn=2.5 * GiB,
                     compile_memory=0.8, compile_time=0.85,
                     optimizer_seconds={"none": 0.05, "activations": 0.05, "optimizer": 1.0})
    assert gpu(_rung(0, "optimizer"), 1).outcome != "ok"  # not even one sample without recompute
    gpu.calls.clear()
    best, notes, controller = _search(gpu, compile=True, fitting_floors=True)
    assert any(r.compile and r.checkpointed_blocks for r, _ in gpu.calls), gpu.calls
    assert best.rung.compile and best.rung.checkpointed_blocks, (best, notes)
    assert_near_the_best_reachable(gpu, best, controller)
