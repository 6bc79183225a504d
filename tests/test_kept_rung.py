"""Trials of optimizer offload that differ only in micro-batch run on one engine: the first trial leaves its rung
on the model and the next takes it, so no FP32 masters are copied out and no weights restored in between, and
that changes nothing a trial measures or computes. Real trials of a tiny GPT on the CPU under the simulated
ceiling, and a fit whose budget leaves only optimizer offload."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from gpt import GPT, GPTConfig, random_batch
from test_trial_reuse import OFFLOAD
from test_trial_reuse import _runner as reuse_runner

import autotune
from autotune.configuration import Rung
from autotune.evidence import Trial
from autotune.search.trial import TrialRunner
from autotune.techniques.offload import host_buffers

# Smaller than test_trial_reuse's GPT: which engines the trials build does not depend on the size, their time does.
CFG = GPTConfig(vocab_size=128, n_layer=2, n_embd=32, n_head=4, seq_len=16)


def _runner() -> TrialRunner:
    """test_trial_reuse's trial runner over this module's GPT."""
    return reuse_runner(CFG)


def _taken() -> int:
    """Host buffers taken so far, built or lent again: every engine built takes its masters' buffer."""
    return host_buffers.COUNTS.built + host_buffers.COUNTS.reused


@contextlib.contextmanager
def _tune(keeping: bool) -> Iterator[None]:
    """What `trials_on` puts around a tune's trials: the host-buffer pool and, with `keeping`, the kept rung."""
    with host_buffers.reusing():
        if not keeping:
            yield
            return
        from autotune.search import kept_rung
        with kept_rung.keeping():
            yield


def _dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    """The dtypes of the weight matrices (norm weights stay FP32 under offload)."""
    return {p.dtype for p in model.parameters() if p.dim() == 2}


def test_a_second_offload_trial_at_another_micro_batch_builds_no_engine_and_restores_nothing() -> None:
    from autotune.search import kept_rung

    runner = _runner()
    model = runner.work.model
    with _tune(keeping=True):
        before, counts = _taken(), kept_rung.COUNTS
        kept, taken, released = counts.kept, counts.taken, counts.released
        first = runner(OFFLOAD, 4)
        built = _taken() - before
        assert built >= 1 and counts.kept == kept + 1  # the first trial built its engine and left it on
        assert _dtypes(model) == {torch.bfloat16}  # not restored: the 16-bit device weights stay
        second = runner(OFFLOAD, 2)
        assert first.fits and second.fits, (first.note, second.note)
        assert _taken() - before == built  # the second built no engine: it ran on the first's
        assert (counts.taken, counts.released) == (taken + 1, released)
        assert "host buffers" not in second.phases  # its set-up built nothing
        runner(Rung(checkpointing="full"), 2)  # another configuration: the engine is undone first
        assert counts.released == released + 1
        assert _dtypes(model) == {torch.float32}
        runner(OFFLOAD, 8)  # left on again, and undone when the tune ends
        assert _taken() - before == 2 * built
        assert _dtypes(model) == {torch.bfloat16}
    assert counts.released == released + 2 and _dtypes(model) == {torch.float32}


def test_a_different_share_or_a_failed_trial_gets_an_engine_of_its_own() -> None:
    runner = _runner()
    with _tune(keeping=True):
        before = _taken()
        runner(OFFLOAD, 2)
        built = _taken() - before
        runner(OFFLOAD, 2, offload_fraction=0.5)  # another host share: another engine
        assert _taken() - before == 2 * built
        runner.work.budget_bytes = runner.work.limit_bytes = 10_000  # nothing fits: the trial runs out of memory
        failed = runner(OFFLOAD, 2, offload_fraction=0.5)
        assert failed.outcome == "oom"
        assert _dtypes(runner.work.model) == {torch.float32}  # a failed trial's rung is never left on


def _sequence(keeping: bool) -> tuple[list[Trial], dict[str, torch.Tensor]]:
    runner = _runner()
    trials = []
    with _tune(keeping):
        for rung, micro in [(OFFLOAD, 4), (OFFLOAD, 2), (OFFLOAD, 8), (Rung(checkpointing="full"), 2), (OFFLOAD, 1)]:
            trials.append(runner(rung, micro))
    return trials, {k: v.detach().clone() for k, v in runner.work.model.state_dict().items()}


def test_trials_on_a_kept_engine_measure_the_same_peaks_and_train_the_same_weights() -> None:
    before = _taken()
    fresh, fresh_weights = _sequence(keeping=False)
    between = _taken()
    kept, kept_weights = _sequence(keeping=True)
    assert (_taken() - between) * 2 == between - before  # two engines built where each of four trials built one
    for a, b in zip(fresh, kept):
        assert (a.outcome, a.micro_batch_size, a.peak_bytes) == (b.outcome, b.micro_batch_size, b.peak_bytes)
        assert a.fits, a.note
    assert fresh_weights.keys() == kept_weights.keys()
    for name, value in fresh_weights.items():  # the trials stepped the model: the same weights, bit for bit
        assert torch.equal(value, kept_weights[name]), name


def _share(trial: Trial) -> str:
    """The host share a trial of optimizer offload ran at, as its note gives it ("" for all of it)."""
    return next((p for p in trial.note.split("; ") if p.startswith(("offload fraction", "optimizer offload,"))), "")


def test_fit_builds_one_engine_for_its_offload_trials_at_several_micro_batches() -> None:
    torch.manual_seed(0)
    model, batch = GPT(CFG), random_batch(CFG, 4)
    one = _runner()(Rung(checkpointing="full"), 1).peak_bytes  # below it only the optimizer's offload fits
    per_engine = _taken()
    _runner()(OFFLOAD, 1)
    per_engine = _taken() - per_engine  # host buffers one engine takes
    before = _taken()
    # Four trials: the plain rung, then optimizer offload climbing its micro-batches (the share and overlap follow).
    plan = autotune.fit(model, batch, global_batch_size=8, memory_budget=int(one * 0.97 / 0.9), device="cpu",
                        cache=False, trial_steps=1, max_trials=4)
    assert plan.offload == "optimizer"
    offloaded = [t for t in plan.trials if t.rung.offload == "optimizer"]
    again = [b for a, b in zip(plan.trials, plan.trials[1:])  # only the micro-batch changed from the trial before
             if b in offloaded and a.fits and (a.rung, _share(a), a.overlapped) == (b.rung, _share(b), b.overlapped)]
    assert again, [(t.rung.name, t.micro_batch_size, t.note) for t in plan.trials]
    engines = (_taken() - before) // per_engine
    # A trial measured again (timings noisy on a loaded machine) ran more than once but keeps one line in the
    # record: each extra run may have built its own engine.
    remeasured = sum(("re-measured" in t.note) + sum(int(n) - 1 for n in re.findall(r"measured (\d+) times", t.note))
                     for t in offloaded)
    assert engines <= len(offloaded) - len(again) + remeasured, (engines, len(offloaded), len(again), remeasured)
    assert engines < len(offloaded) + remeasured  # at least one trial ran on the engine before it
    assert _dtypes(model) == {torch.float32}  # the user's model as it was


def test_the_rate_at_the_examples_length_counts_flops_on_the_model_as_fit_found_it() -> None:
    """The trial at the example's own length may leave optimizer offload's rung on the model; the FLOP count after
    it runs the model without that rung (a forward on its 16-bit weights without autocast failed), and counts what
    the plain model counts."""
    from autotune.search import typical
    from autotune.search.flops import count_flops
    from autotune.search.kept_rung import COUNTS
    from autotune.search.ledger import Ledger

    runner = _runner()
    work = runner.work
    short = random_batch(GPTConfig(**{**CFG.__dict__, "seq_len": CFG.seq_len // 2}), 8)
    plain = count_flops(work.model, short, work.loss_fn, work.placement).per_sample
    with _tune(keeping=True):
        state = Ledger(runner=runner, per_rank=8, limit=2**39, cap=8, max_trials=4)
        state.pick = runner(OFFLOAD, 4)
        kept = COUNTS.kept
        rate, note = typical.measure(state, work, short)
        assert COUNTS.kept == kept + 1  # the trial at the example's length left its rung on
        assert _dtypes(work.model) == {torch.float32}  # and the count ran without it
    assert rate is not None, note
    assert rate.flops.per_sample == plain and rate.length == CFG.seq_len // 2


def test_the_trial_at_the_examples_length_pads_attention_no_further_than_the_search(monkeypatch) -> None:
    """The trial at the example's own length, on a rung of its own (not kept), pads attention no further than the
    search's trials at `max_length`, as training does: a compiled graph holds that limit, and another would compile
    the blocks again."""
    from autotune.search import typical
    from autotune.search.ledger import Ledger
    from autotune.techniques import attention_lengths

    limits: list[int | None] = []
    install = attention_lengths.install
    monkeypatch.setattr(attention_lengths, "install",
                        lambda kind, longest=None: limits.append(longest) or install(kind, longest))
    runner = _runner()
    short = random_batch(GPTConfig(**{**CFG.__dict__, "seq_len": CFG.seq_len // 2}), 8)
    state = Ledger(runner=runner, per_rank=8, limit=2**39, cap=8, max_trials=4)
    state.pick = runner(Rung(checkpointing="full"), 4)
    rate, note = typical.measure(state, runner.work, short)
    assert rate is not None and rate.length == CFG.seq_len // 2, note
    assert limits == [CFG.seq_len, CFG.seq_len], limits  # the search's trial, then the example's
