"""A NaN or infinite loss fails its trial with the reason (never the chosen plan); where every trial sees one,
`fit` raises `InvalidSetting` naming the example batch, and nothing is cached."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import autotune
from autotune.configuration import Rung
from autotune.devices.placement import resolve_device
from autotune.search.trial import TrialRunner, Workload
from autotune.workload.optimizers import OptimizerSpec


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def _regression(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(n, 16), torch.randn(n, 1)


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]).float(), batch[1])


def _fit(model: nn.Module, batch: object, **kw: object) -> autotune.Plan:
    kw.setdefault("cache", False)
    kw.setdefault("loss_fn", mse)
    return autotune.fit(model, batch, device="cpu", memory_budget="64MiB", trial_steps=1, **kw)  # type: ignore[arg-type]


def test_a_trial_whose_loss_is_nan_fails_with_the_reason() -> None:
    model = _mlp()
    x, y = _regression()
    x[0, 0] = float("nan")
    work = Workload(model=model, batch=(x, y), loss_fn=mse, spec=OptimizerSpec.from_user(None, model),
                    placement=resolve_device("cpu"), budget_bytes=2**30, limit_bytes=2**30, per_rank=8,
                    measured_steps=1)
    trial = TrialRunner(work)(Rung(precision="fp32"), 4)
    assert trial.outcome == "non_finite" and not trial.fits and trial.samples_per_second == 0.0
    assert trial.note == "loss nan on the example batch (the warm-up steps)"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_example_batch_with_a_nan_fails_fit_naming_the_batch_and_caches_nothing(tmp_path: Path,
                                                                                 bad: float) -> None:
    x, y = _regression()
    x[:, 3] = bad  # every sample: no micro-batch escapes it
    with pytest.raises(autotune.InvalidSetting, match=r"the loss was NaN or infinite on the example batch in every "
                       r"configuration tried \(loss nan on the example batch .* in bf16 @ 1.*fp32 @ 1.*\): check the "
                       r"example batch \(fit's `batch`\) for NaN or infinite values, and the model's initialisation"):
        _fit(_mlp(), (x, y), cache=tmp_path / "plans.db")
    with autotune.PlanCache(tmp_path / "plans.db") as cache:
        assert cache.list() == [] and cache.nothing_fits_entries() == []


def test_a_loss_that_overflows_in_16_bits_only_gives_an_fp32_plan_that_says_why() -> None:
    class Overflows(nn.Module):
        """A model whose 16-bit forward overflows (as fp16 does past 65504): its loss is infinite under autocast."""

        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.net(x)
            return out * float("inf") if torch.is_autocast_enabled("cpu") else out

    model, batch = Overflows(), _regression()
    plan = _fit(model, batch)
    assert plan.precision == "fp32" and plan.trials[0].outcome == "non_finite"
    assert all(t.outcome == "non_finite" for t in plan.trials if t.rung.precision == "bf16")
    assert plan.reason.startswith("bf16 failed in"), plan.reason
    assert "loss inf on the example batch" in plan.reason and "the search went on in fp32" in plan.reason
    step = plan.apply(model, loss_fn=mse)
    try:
        assert torch.isfinite(torch.tensor(step(batch)))
    finally:
        step.close()


def test_a_nan_in_some_samples_fails_the_micro_batches_holding_them_and_the_reason_says_so() -> None:
    x, y = _regression()
    # The second sample: only micro-batch 1 is clean, and the search always probes a second size after its
    # first (a NaN later in the batch is reached only where growth pays, which a loaded machine's timings decide).
    x[1, 0] = float("nan")
    plan = _fit(_mlp(), (x, y), techniques=("bf16",))
    assert plan.micro_batch_size == 1
    assert any(t.outcome == "non_finite" and t.micro_batch_size >= 2 for t in plan.trials)
    assert "left out after failing: loss nan on the example batch" in plan.reason, plan.reason
