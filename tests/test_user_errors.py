"""What a new user gets wrong first, answered with a clear message and a documented exit code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from subprocess_env import with_path
from torch import nn

import autotune
from autotune.sizes import format_bytes

ROOT = Path(__file__).resolve().parents[1]


class Classifier(nn.Module):
    """A forward that takes the inputs alone, as most vision and tabular models do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_a_budget_over_the_devices_memory_is_refused_naming_its_size() -> None:
    host = format_bytes(psutil.virtual_memory().total)
    with pytest.raises(autotune.InvalidSetting, match=rf"memory_budget 1,024.00 GiB is over .* has {host} of host"):
        autotune.fit(nn.Linear(4, 4), torch.randn(2, 4), device="cpu", memory_budget="1TiB", cache=False)


def test_an_x_y_batch_without_loss_fn_says_which_loss_fn_to_pass() -> None:
    batch = (torch.randn(4, 8), torch.randint(0, 3, (4,)))
    with pytest.raises(autotune.InvalidSetting, match=r"tuple of 2 .*Classifier.forward does not take.*loss_fn="):
        autotune.fit(Classifier(), batch, device="cpu", memory_budget="64MiB", cache=False)


def test_a_type_error_inside_the_models_own_forward_is_left_untouched() -> None:
    class Broken(Classifier):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            raise TypeError("the model's own bug")

    with pytest.raises(TypeError, match="the model's own bug"):
        autotune.fit(Broken(), (torch.randn(4, 8), torch.randn(4)), device="cpu", memory_budget="64MiB", cache=False)


@pytest.mark.slow  # seconds: starts processes that import torch
def test_a_script_that_never_calls_fit_run_without_map_warns_and_exits_5(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('trained without autotune')\n")
    env = with_path(ROOT, AUTOTUNE_CACHE=str(tmp_path / "plans.db"))
    done = subprocess.run([sys.executable, "-m", "autotune", "run", "--global-batch-size", "8", str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 5, done.stderr
    assert "trained without autotune" in done.stdout  # the job itself ran, untouched
    assert "nothing was tuned" in done.stderr and "--map micro_batch=FLAG" in done.stderr


def test_autotune_run_refuses_a_budget_over_the_devices_memory_before_any_trial() -> None:
    from autotune.supervisor.zero_change import resolve_target

    host = format_bytes(psutil.virtual_memory().total)
    with pytest.raises(autotune.InvalidSetting, match=rf"--budget 1,024.00 GiB is over .* has {host}"):
        resolve_target("cpu", "1TiB")
    assert resolve_target("cpu", "40MiB").budget_bytes == 40 * 2**20
