"""A configuration that fails with an error other than out-of-memory is recorded with its error and the search
goes on: a bf16 kernel this CPU lacks gives an fp32 plan that says why; `fit` raises only where every
configuration failed, the model's own exception untouched where every configuration raised it."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import autotune
from autotune import parallel as distributed
from autotune.configuration import Rung
from autotune.evidence import Trial

# What oneDNN raises for an LSTM in bf16 on a CPU without that kernel.
MISSING_KERNEL = "could not create a primitive descriptor for the LSTM forward propagation primitive"


def _in_bf16(x: torch.Tensor) -> bool:
    return torch.is_autocast_enabled(x.device.type) and torch.get_autocast_dtype(x.device.type) == torch.bfloat16


class LstmWithoutBf16Kernel(nn.LSTM):
    """nn.LSTM on a CPU whose oneDNN has no bf16 LSTM kernel: under bf16 autocast (which runs the LSTM in bf16)
    its forward raises the error oneDNN raises there; in fp32 it is nn.LSTM."""

    def forward(self, x, hx=None):  # type: ignore[override]
        if _in_bf16(x):
            raise RuntimeError(MISSING_KERNEL)
        return super().forward(x, hx)


class Tagger(nn.Module):
    """Tokens in, a tag per token out, through an LSTM."""

    def __init__(self, lstm: type[nn.LSTM] = nn.LSTM, vocab: int = 50, tags: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.lstm = lstm(16, 32, batch_first=True)
        self.head = nn.Linear(32, tags)

    def forward(self, tokens: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(tokens))
        logits = self.head(hidden)
        return F.cross_entropy(logits.flatten(0, 1).float(), tags.flatten())


def _tagging(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randint(0, 50, (n, 12)), torch.randint(0, 5, (n, 12))


def _fit(model: nn.Module, batch: object, **kw: object) -> autotune.Plan:
    kw.setdefault("cache", False)
    return autotune.fit(model, batch, device="cpu", memory_budget="256MiB", trial_steps=1,
                        loss_fn=lambda m, b: m(*b), **kw)  # type: ignore[arg-type]


def test_fit_on_an_lstm_whose_bf16_kernel_is_missing_returns_an_fp32_plan_that_says_why() -> None:
    model, batch = Tagger(LstmWithoutBf16Kernel), _tagging()
    plan = _fit(model, batch)
    assert plan.precision == "fp32"
    assert "bf16 failed in" in plan.reason and f"RuntimeError: {MISSING_KERNEL}" in plan.reason, plan.reason
    assert "so the search went on in fp32" in plan.reason, plan.reason
    failed = [t for t in plan.trials if t.outcome == "error"]
    assert failed and all(t.rung.precision == "bf16" and MISSING_KERNEL in t.note for t in failed), plan.trials
    assert any(t.fits and t.rung.precision == "fp32" for t in plan.trials)
    step = plan.apply(model, loss_fn=lambda m, b: m(*b))
    try:
        assert torch.isfinite(torch.tensor(step(batch)))
    finally:
        step.close()


def test_fit_on_this_cpus_own_lstm_returns_a_plan_and_says_why_where_bf16_fails() -> None:
    plan = _fit(Tagger(), _tagging())
    # This CPU's bf16 LSTM runs (a plan in bf16), or it raises and the plan is fp32, saying so.
    assert plan.precision == "bf16" or ("bf16 failed" in plan.reason and plan.precision == "fp32"), plan.reason


def test_the_failed_steps_tensors_are_let_go_while_the_search_goes_on() -> None:
    held: list[weakref.ref[torch.Tensor]] = []

    class Leaky(Tagger):
        def forward(self, tokens: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
            activations = self.embed(tokens) * 2  # a local of the failing frame, as a step's activations are
            held.append(weakref.ref(activations))
            if _in_bf16(activations):
                raise RuntimeError(MISSING_KERNEL)
            return super().forward(tokens, tags)

    plan = _fit(Leaky(), _tagging())
    gc.collect()
    assert plan.precision == "fp32"
    assert held and all(ref() is None for ref in held)


def test_an_error_at_larger_micro_batches_only_leaves_those_out() -> None:
    class Capped(Tagger):  # a kernel that refuses batches over 2 (not for want of memory)
        def forward(self, tokens: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
            if tokens.shape[0] > 2:
                raise RuntimeError(f"kernel supports at most 2 sequences, got {tokens.shape[0]}")
            return super().forward(tokens, tags)

    plan = _fit(Capped(), _tagging(), techniques=("bf16",))
    # The search goes on at 2 and below (which of them wins is a matter of timing): only the larger are out.
    assert plan.micro_batch_size <= 2 and plan.micro_batch_size * plan.accumulation_steps == 8
    assert any(t.outcome == "ok" and t.micro_batch_size == 2 for t in plan.trials), plan.trials
    assert any(t.outcome == "error" and "at most 2 sequences" in t.note for t in plan.trials)
    assert "left out after failing: RuntimeError: kernel supports at most 2 sequences" in plan.reason, plan.reason


class BrokenStep(torch.optim.SGD):
    """An optimizer whose step has the user's bug (the model's forward, run before any trial, is fine)."""

    def step(self, closure=None):  # type: ignore[override]
        raise RuntimeError("the optimizer's step is broken")


def test_distinct_errors_in_every_configuration_are_each_named() -> None:
    class NoBf16(Tagger):
        def forward(self, tokens: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled("cpu"):
                raise ValueError("the bf16 path is broken")
            return super().forward(tokens, tags)

    expected = (r"2 distinct failure\(s\).*ValueError: the bf16 path is broken in bf16 @ 1.*"
                r"RuntimeError: the optimizer's step is broken in fp32 @ 1")
    with pytest.raises(autotune.AutotuneError, match=expected) as caught:
        _fit(NoBf16(), _tagging(), optimizer=lambda params: BrokenStep(params, lr=0.1), techniques=("bf16",))
    assert not isinstance(caught.value, autotune.NoFeasiblePlan)  # not a verdict on memory, which the cache keeps


def test_the_same_error_in_every_configuration_is_the_users_own_and_raised_untouched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16 as this CPU runs it: where it is emulated, oneDNN has no bf16 LSTM, a second error the user's is not
    monkeypatch.delenv("AUTOTUNE_CPU_BF16", raising=False)
    for _ in range(2):  # the second fit is not served a cached verdict: it fails the same way
        with pytest.raises(RuntimeError, match="^the optimizer's step is broken$") as caught:
            _fit(Tagger(), _tagging(), optimizer=lambda params: BrokenStep(params, lr=0.1), techniques=("bf16",),
                 cache=tmp_path / "plans.db")
        assert type(caught.value) is RuntimeError and caught.value.__context__ is None
        assert caught.traceback[-1].name == "step"  # raised where the user's code raised it
    with autotune.PlanCache(tmp_path / "plans.db") as cache:
        assert cache.list() == [] and cache.nothing_fits_entries() == []  # no plan, no verdict kept


def test_a_failure_on_another_rank_fails_the_trial_on_every_rank() -> None:
    rung = Rung(precision="bf16")
    mine = Trial(rung=rung, micro_batch_size=4, outcome="ok", peak_bytes=2**20, step_seconds=0.1,
                 samples_per_second=40.0)
    for outcome, said in (("error", "an error on another rank"), ("non_finite", "a NaN or infinite loss on another")):
        theirs = Trial(rung=rung, micro_batch_size=4, outcome=outcome, peak_bytes=2**19)
        agreed = [max(a, b) for a, b in zip(distributed.trial_figures(mine), distributed.trial_figures(theirs))]
        merged = distributed.merged_trial(mine, agreed)
        assert merged.outcome == outcome and merged.note.startswith(said) and merged.samples_per_second == 0.0
