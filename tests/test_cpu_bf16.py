"""On the CPU, `fit` searches bf16 where the CPU runs it natively and leaves it out, with the reason, where torch
would emulate it (several times slower than fp32); zero-change mode keeps a script's own fp32 on the CPU and says
which of the two reasons holds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotune
from autotune.devices import placement
from autotune.errors import InvalidSetting
from autotune.supervisor.zero_change import CPU_SCRIPT_BF16, resolve_target


def _fit() -> autotune.Plan:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    batch = (torch.randn(8, 32), torch.randint(0, 4, (8,)))
    return autotune.fit(model, batch, global_batch_size=8, device="cpu", memory_budget="64MiB", cache=False,
                        trial_steps=1, loss_fn=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))


@pytest.mark.parametrize(("flags", "native"), [
    ("fpu sse2 avx2 avx512f avx512bw", False),          # x86 without BF16: emulated
    ("fpu avx2 avx512f avx512_bf16", True),              # Cooper Lake and later
    ("fpu avx2 avx512f amx_tile amx_bf16", True),        # Sapphire Rapids' AMX
    ("fp asimd evtstrm aes sha2 crc32 atomics", False),  # Graviton 2
    ("fp asimd sve i8mm bf16", True),                    # Graviton 3
    ("", False),                                          # nothing known: emulated, the safe side
])
def test_native_bf16_is_read_from_the_cpus_features(flags: str, native: bool) -> None:
    assert placement.cpu_has_native_bf16(flags) is native


def test_a_cpu_without_native_bf16_gets_an_fp32_plan_that_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    # This machine's CPU may have native bf16; the decision is taken from the features read here, by default.
    monkeypatch.delenv("AUTOTUNE_CPU_BF16", raising=False)
    monkeypatch.setattr(placement, "cpu_has_native_bf16", lambda flags=None: False)
    plan = _fit()
    assert plan.precision == "fp32" and {t.rung.precision for t in plan.trials} == {"fp32"}, plan.trials
    assert placement.NO_NATIVE_BF16 in plan.reason, plan.reason
    target = resolve_target("cpu", None)
    assert target.bf16_off == placement.NO_NATIVE_BF16


def test_a_cpu_with_native_bf16_measures_bf16_in_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AUTOTUNE_CPU_BF16", raising=False)
    monkeypatch.setattr(placement, "cpu_has_native_bf16", lambda flags=None: True)
    plan = _fit()
    assert "bf16" in {t.rung.precision for t in plan.trials}, plan.trials
    assert placement.NO_NATIVE_BF16 not in plan.reason
    # a script's bf16 flag stays off on the CPU: it is written for a GPU, and the reason says so
    assert resolve_target("cpu", None).bf16_off == CPU_SCRIPT_BF16


@pytest.mark.parametrize("native", [False, True])
def test_the_cpu_bf16_switch_overrides_the_cpus_features_either_way(monkeypatch: pytest.MonkeyPatch,
                                                                     native: bool) -> None:
    monkeypatch.setattr(placement, "cpu_has_native_bf16", lambda flags=None: native)
    monkeypatch.setenv("AUTOTUNE_CPU_BF16", "1")
    plan = _fit()
    assert "bf16" in {t.rung.precision for t in plan.trials}, plan.trials
    assert placement.NO_NATIVE_BF16 not in plan.reason
    monkeypatch.setenv("AUTOTUNE_CPU_BF16", "0")
    plan = _fit()
    assert {t.rung.precision for t in plan.trials} == {"fp32"}, plan.trials


def test_a_garbage_cpu_bf16_switch_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTUNE_CPU_BF16", "maybe")
    with pytest.raises(InvalidSetting, match="AUTOTUNE_CPU_BF16='maybe' is neither on nor off"):
        _fit()
