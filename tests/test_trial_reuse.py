"""Trials of optimizer offload that differ only in micro-batch pass their host buffers on instead of building them
again, and that changes nothing a trial measures or computes: real trials of a small GPT on the CPU under the
simulated ceiling, and a fit whose budget leaves only optimizer offload."""

from __future__ import annotations

import pytest
import torch
from gpt import GPT, GPTConfig, random_batch

import autotune
from autotune.configuration import Rung
from autotune.devices.placement import resolve_device
from autotune.evidence import Trial
from autotune.search.trial import TrialRunner, Workload
from autotune.techniques import find_blocks
from autotune.techniques.offload import host_buffers
from autotune.workload.losses import resolve
from autotune.workload.optimizers import OptimizerSpec

CFG = GPTConfig(vocab_size=128, n_layer=4, n_embd=64, n_head=4, seq_len=64)
OFFLOAD = Rung(checkpointing="full", offload="optimizer")


def _runner(cfg: GPTConfig = CFG) -> TrialRunner:
    """Trials of a GPT at `cfg`: one measured step each, under a ceiling nothing reaches."""
    torch.manual_seed(0)
    model = GPT(cfg)
    work = Workload(model=model, batch=random_batch(cfg, 8), loss_fn=resolve(None),
                    spec=OptimizerSpec.from_user(None, model), placement=resolve_device("cpu"), budget_bytes=2**40,
                    limit_bytes=2**39, per_rank=8, blocks=find_blocks(model), measured_steps=1)
    return TrialRunner(work)


def _counts() -> tuple[int, int]:
    return host_buffers.COUNTS.built, host_buffers.COUNTS.reused


def test_a_second_trial_at_another_micro_batch_builds_no_host_buffer() -> None:
    runner = _runner()
    with host_buffers.reusing() as pool:
        before = _counts()
        first = runner(OFFLOAD, 4)
        after_first = _counts()
        second = runner(OFFLOAD, 2)
        after_second = _counts()
        assert first.fits and second.fits, (first.note, second.note)
        built = after_first[0] - before[0]
        assert built >= 1  # the first trial built the FP32 masters' buffer
        assert after_second[0] == after_first[0]  # the second built none...
        assert after_second[1] - after_first[1] == built  # ...and was lent every one the first built
        assert not pool.lent and len(pool.free) == built  # handed back at clean-up, held for the next trial
    # outside a tune nothing is pooled: a trial builds its buffers again
    runner(OFFLOAD, 2)
    assert _counts()[0] == after_second[0] + built


def _sequence(pooled: bool) -> tuple[list[Trial], dict[str, torch.Tensor]]:
    runner = _runner()
    trials = []
    with host_buffers.reusing() if pooled else _nothing():
        for rung, micro in [(OFFLOAD, 4), (OFFLOAD, 2), (Rung(checkpointing="full"), 2), (OFFLOAD, 8)]:
            trials.append(runner(rung, micro))
    return trials, {k: v.detach().clone() for k, v in runner.work.model.state_dict().items()}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.slow  # seconds: searches that run real trial steps
def test_reused_buffers_change_no_outcome_peak_or_weight() -> None:
    built = _counts()[0]
    fresh, fresh_weights = _sequence(pooled=False)
    assert _counts()[0] - built == 3  # without the pool each offload trial builds its own
    reused_before = _counts()[1]
    pooled, pooled_weights = _sequence(pooled=True)
    assert _counts()[1] - reused_before == 2  # with it the second and third offload trials build none
    for a, b in zip(fresh, pooled):
        assert (a.outcome, a.micro_batch_size, a.peak_bytes) == (b.outcome, b.micro_batch_size, b.peak_bytes)
    # the trials stepped the model: the same weights either way, bit for bit
    assert fresh_weights.keys() == pooled_weights.keys()
    for name, value in fresh_weights.items():
        assert torch.equal(value, pooled_weights[name]), name


@pytest.mark.slow  # seconds: searches that run real trial steps
def test_fit_passes_host_buffers_between_its_offload_trials_and_frees_them() -> None:
    torch.manual_seed(0)
    model, batch = GPT(CFG), random_batch(CFG, 4)
    runner = _runner()
    one = runner(Rung(checkpointing="full"), 1).peak_bytes  # below it only the optimizer's offload fits
    before = _counts()
    plan = autotune.fit(model, batch, global_batch_size=8, memory_budget=int(one * 0.97 / 0.9), device="cpu",
                        cache=False, trial_steps=1)
    assert plan.offload == "optimizer"
    offloaded = [t for t in plan.trials if t.rung.offload == "optimizer"]
    assert len(offloaded) >= 2, [(t.rung.name, t.micro_batch_size) for t in plan.trials]
    built, reused = _counts()[0] - before[0], _counts()[1] - before[1]
    # every engine after the first was lent the buffers (a trial on the engine the last one left takes none)
    assert built >= 1 and reused >= built and built + reused <= built * len(offloaded), (built, reused, len(offloaded))
    assert not host_buffers._pool  # the tune's pool is gone with the tune


def test_the_pool_lends_the_smallest_buffer_that_serves_wherever_it_lies_in_the_free_list() -> None:
    """Buffers of several sizes lie free after an overlapped trial at a host share (its masters, moments and spare
    set) beside a larger one from a whole-model trial: the pool finds the one to lend by identity, never by
    comparing the tensors (elementwise, an error where their sizes differ)."""
    pool = host_buffers.HostBuffers()
    big, small = pool.take(100, False), pool.take(60, False)
    pool.reclaim()
    lent = pool.take(50, False)
    assert lent.numel() == 50 and lent.data_ptr() == small.data_ptr()  # the smallest that holds 50 bytes
    assert [b[1].numel() for b in pool.free] == [100]
    pool.reclaim()
    grown = pool.take(200, False)  # none holds 200: the smallest free one goes, a new one is built
    assert grown.numel() == 200 and [b[1].data_ptr() for b in pool.free] == [big.data_ptr()]


@pytest.mark.parametrize("streamed", [True, False])
def test_trials_at_shrinking_host_shares_overlapped_run_on_the_pools_buffers(monkeypatch: pytest.MonkeyPatch,
                                                                             streamed: bool) -> None:
    """What a tune runs after its pick: the whole optimizer offloaded, then a share of it overlapped, then a
    smaller share overlapped (the example's own length measures the pick once more the same way). The streamed
    engine (the GPU's; on the CPU test device by $AUTOTUNE_OFFLOAD_STREAM=1) leaves masters, moments and a spare
    set of several sizes in the pool; every trial still runs, lent what the pool holds."""
    from autotune import settings
    monkeypatch.setenv(settings.OFFLOAD_STREAM_ENV, "1" if streamed else "0")
    runner = _runner()
    with host_buffers.reusing():
        trials = [runner(OFFLOAD, 4, offload_fraction=share, overlap=overlapped)
                  for share, overlapped in [(1.0, False), (0.5, True), (0.3, True), (0.3, True)]]
        reused = _counts()[1]
    assert [t.outcome for t in trials] == ["ok"] * 4, [t.note for t in trials]
    assert reused > 0
