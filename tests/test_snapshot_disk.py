"""fit's copy of a large model goes to a temporary file, not to RAM, and puts every tensor back bitwise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotune.search import snapshot as snapshots
from autotune.techniques import host_need
from autotune.techniques.host_need import offload_need, with_snapshot


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)).to(torch.bfloat16)
    model[1].num_batches_tracked += 7  # an int64 buffer
    return model


def test_a_snapshot_on_disk_holds_no_tensor_in_ram_and_restores_bitwise() -> None:
    model = _model()
    before = [t.clone() for t in [*model.parameters(), *model.buffers()]]
    snap = snapshots.Snapshot.take(model, to_disk=True)
    assert snap.disk is not None and snap.disk.size == host_need.model_bytes(model)
    assert not any(isinstance(saved, torch.Tensor) for _, saved in snap.tensors)
    with torch.no_grad():  # what trials do: new weights, other dtypes, moved statistics
        for p in model.parameters():
            p.data = p.data.float().add_(1.0)
        model[1].num_batches_tracked += 1
    snap.restore()
    after = [*model.parameters(), *model.buffers()]
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(after, before))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_tensors_larger_than_a_staging_buffer_go_through_it_in_chunks_and_come_back_bitwise(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setattr(snapshots, "STAGE_BYTES", 24)  # the first weight's 1 KiB in bf16 is 43 chunks
    model = _model().to(device)
    before = [t.clone() for t in [*model.parameters(), *model.buffers()]]
    snap = snapshots.Snapshot.take(model, to_disk=True)
    assert snap.disk is not None and snap.disk.size == host_need.model_bytes(model)
    assert not snap.disk._stages  # no staging buffer held between passes, so none beside the trials
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.zero_()
    snap.restore_values()
    after = [*model.parameters(), *model.buffers()]
    assert all(a.device == b.device and torch.equal(a, b) for a, b in zip(after, before))


def test_only_a_large_model_on_a_gpu_goes_to_disk_and_then_costs_no_host_memory() -> None:
    model = _model()
    assert not host_need.snapshot_on_disk(model)  # on the CPU, and small
    need = with_snapshot(offload_need(list(model.parameters()), fraction=1.0, state_tensors=2, cuda=False,
                                      streamed=False, overlap=False), model)
    assert need.snapshot == host_need.model_bytes(model)


def test_a_folder_in_memory_is_no_disk_for_the_snapshot() -> None:
    import psutil

    in_memory = [m.mountpoint for m in psutil.disk_partitions(all=True) if m.fstype == "tmpfs"]
    if in_memory:
        assert host_need.in_memory_filesystem(in_memory[0])
    assert not host_need.in_memory_filesystem("/proc/self")  # procfs: not tmpfs or ramfs
