"""Host memory: the cgroup's room, and the host bytes a configuration needs, against what optimizer offload
really allocates (counted tensor by tensor after a real step, not asserted from the same arithmetic)."""

from __future__ import annotations

import os

import pytest
import torch
from subprocess_env import with_path
from torch import nn

from autotune.devices import host
from autotune.techniques.host_need import model_bytes, offload_need, with_snapshot
from autotune.techniques.offload import HostOptimizer, StreamedEngine, build_engine
from autotune.workload.optimizers import OptimizerSpec, state_tensors_per_parameter


def test_cgroup_v2_room_is_its_limit_less_its_usage(tmp_path):
    (tmp_path / "memory.max").write_text("1000\n")
    (tmp_path / "memory.current").write_text("400\n")
    assert host.cgroup_room(tmp_path, tmp_path / "none") == 600
    (tmp_path / "memory.max").write_text("max\n")  # v2 without a limit, and no v1 hierarchy
    assert host.cgroup_room(tmp_path, tmp_path / "none") is None


def test_cgroup_v1_room_and_its_huge_no_limit(tmp_path):
    v1 = tmp_path / "memory"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text(str(2**30))
    (v1 / "memory.usage_in_bytes").write_text(str(2**29))
    assert host.cgroup_room(tmp_path / "nov2", v1) == 2**29
    (v1 / "memory.limit_in_bytes").write_text(str(2**63 - 4096))  # what v1 reports without a limit
    assert host.cgroup_room(tmp_path / "nov2", v1) is None


def test_the_default_host_budget_is_under_what_is_available():
    available = host.available_bytes()
    assert 0 < host.default_budget() < available
    assert host.resident_bytes() > 0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64)
        self.b = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x))).pow(2).mean()


def _host_bytes(host_opt: HostOptimizer) -> int:
    """Bytes of every host tensor the offload holds: masters, their gradients, the optimizer's state."""
    shares = host_opt.shares
    tensors = [t for m in shares.master.values() for t in (m, m.grad)]
    tensors += [v for s in shares.optimizer.state.values() for v in s.values() if v.dim()]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_offload_need_is_what_the_host_optimizer_allocates(fraction, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_STREAM", "0")  # the CPU step: masters, gradients and torch's AdamW state
    torch.manual_seed(0)
    model = Net()
    params = [p for p in model.parameters() if p.requires_grad]
    spec = OptimizerSpec.from_user(torch.optim.AdamW(params, lr=1e-3), model)
    host_opt = build_engine(params, spec, torch.bfloat16, fraction=fraction, overlap=False)
    model(torch.randn(4, 32).to(torch.bfloat16)).backward()
    host_opt.step()  # the state appears at the first step
    need = offload_need(params, fraction=fraction, state_tensors=state_tensors_per_parameter(spec), cuda=False,
                        streamed=False, overlap=False)
    assert need.total == _host_bytes(host_opt)
    assert need.state == 2 * need.masters  # AdamW: two moments the size of the FP32 masters
    host_opt.restore()


def test_the_streamed_step_allocates_its_need_and_no_host_gradients(monkeypatch):
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_STREAM", "1")  # the GPU's step, run on the CPU test device
    torch.manual_seed(0)
    model = Net()
    params = [p for p in model.parameters() if p.requires_grad]
    spec = OptimizerSpec.from_user(torch.optim.AdamW(params, lr=1e-3), model)
    host_opt = build_engine(params, spec, torch.bfloat16, fraction=1.0, overlap=True)
    assert isinstance(host_opt, StreamedEngine) and host_opt.overlap and host_opt.stepper is not None
    model(torch.randn(4, 32).to(torch.bfloat16)).backward()
    host_opt.step()
    stepper = host_opt.stepper
    assert all(m.grad is None for m in host_opt.shares.master.values())  # it reads the device gradients
    held = [host_opt.shares.flat, stepper._m, stepper._v, *(stepper._spare or ())]
    need = offload_need(params, fraction=1.0, state_tensors=state_tensors_per_parameter(spec), cuda=False,
                        streamed=True, overlap=True)
    assert need.gradients == 0
    assert need.total == sum(t.numel() * t.element_size() for t in held)
    host_opt.restore()


def test_streamed_overlap_adds_a_second_set_and_partitions_divide():
    params = list(Net().parameters())
    one = offload_need(params, fraction=1.0, state_tensors=2, cuda=True, streamed=True, overlap=True)
    assert one.overlap == one.masters + one.state and one.staging == 0
    halves = offload_need(params, fraction=1.0, state_tensors=2, cuda=True, streamed=True, overlap=True, ranks=2)
    assert halves.total == pytest.approx(one.total / 2, abs=16)
    cpu_step = offload_need(params, fraction=1.0, state_tensors=2, cuda=True, streamed=False, overlap=True)
    assert cpu_step.staging == sum(p.numel() for p in params) * 2  # a bf16 copy of each, out and back
    assert offload_need(params, fraction=0.0, state_tensors=2, cuda=True, streamed=True, overlap=True).total == 0


def test_the_snapshot_counts_the_model_as_it_is():
    model = Net().to(torch.float64)
    need = with_snapshot(offload_need(list(model.parameters()), fraction=1.0, state_tensors=2, cuda=False,
                                      streamed=False, overlap=False), model)
    assert need.snapshot == model_bytes(model) == sum(p.numel() * 8 for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())
    assert need.masters == need.snapshot  # float64 masters keep their width
    assert "snapshot" in need.describe() and os.linesep not in need.describe()


@pytest.mark.slow  # a torch process running eleven trials
def test_a_trial_measures_the_host_memory_it_raises_and_ten_in_a_row_do_not_add_up():
    """Each optimizer-offload trial's measured rise covers its host buffers, and the process after ten such
    trials holds no more than after the first plus a small slack: nothing a trial allocates outlives it.
    In a fresh process, as a user's tune runs: one that ran other tests first reuses heap memory they freed."""
    import json
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = "import json, test_host_memory as t; print(json.dumps(t.ten_offload_trials()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=here, capture_output=True, text=True, timeout=300,
                         env=with_path(here, os.path.dirname(here)))
    assert out.returncode == 0, out.stderr[-3000:]
    rises, after, buffers = json.loads(out.stdout.strip().splitlines()[-1])
    # Measured by the kernel's high-water mark, not computed: each rise holds the host optimizer's buffers.
    assert all(r >= 0.8 * buffers for r in rises), (rises, buffers)
    # Ten trials leave the process where one did, within a fifth of one configuration's buffers.
    assert after[-1] - after[0] <= 0.2 * buffers, (after, buffers)


def ten_offload_trials() -> tuple[list[int], list[int], int]:
    """Ten trials of full optimizer offload on a 6.3M-parameter model: each trial's measured host rise, the
    process's resident bytes after each, and what the host optimizer's buffers need by arithmetic."""
    from test_offload import Wide

    from autotune.configuration import Rung
    from autotune.devices.host import resident_bytes
    from autotune.devices.placement import resolve_device
    from autotune.search.host_budget import need
    from autotune.search.trial import TrialRunner, Workload
    from autotune.workload.losses import resolve

    torch.manual_seed(0)
    model = Wide(width=1024, depth=6)
    spec = OptimizerSpec.from_user(None, model)
    budget = 2**34
    work = Workload(model=model, batch=torch.randn(8, 1024), loss_fn=resolve(None), spec=spec,
                    placement=resolve_device("cpu"), budget_bytes=budget, limit_bytes=int(0.9 * budget), per_rank=8,
                    warmup_steps=1, measured_steps=1)
    rung = Rung(offload="optimizer")
    runner = TrialRunner(work)
    rises, after = [], []
    for _ in range(10):
        trial = runner(rung, 8)
        assert trial.fits, trial.note
        rises.append(trial.host_peak_bytes)
        after.append(resident_bytes())
    return rises, after, need(rung, model, spec, "cpu", snapshot=False).total
