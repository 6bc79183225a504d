"""Large pinned host buffers take their exact size, and CUDA copies from them asynchronously."""

from __future__ import annotations

import pytest
import torch

from autotune.techniques.offload.pinned import EXACT_FROM, pinned_empty, pinned_like


def test_without_cuda_a_buffer_is_plain_host_memory_of_its_size() -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU build's path")
    t = pinned_empty(EXACT_FROM // 4 + 3)
    assert t.shape == (EXACT_FROM // 4 + 3,) and t.dtype == torch.float32 and not t.is_pinned()
    assert pinned_like(torch.zeros(2, 3, dtype=torch.bfloat16)).shape == (2, 3)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.gpu
def test_a_large_pinned_buffer_holds_its_own_size_and_copies_asynchronously() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.cuda.init()
    numel = (3 * EXACT_FROM // 2) // 4  # 1.5x the threshold: torch's allocator would round it up to 2x
    pinned_empty(EXACT_FROM // 4)  # registered and freed: the driver's first-use memory, unmeasured
    before = _rss()
    host = pinned_empty(numel)
    rise = _rss() - before
    assert host.is_pinned() and host.numel() == numel
    assert rise < 1.1 * numel * 4  # its size, not the next power of two
    source = torch.arange(numel, dtype=torch.float32, device="cuda")
    host.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host[-5:], source[-5:].cpu())
    del host  # unregistered, then unmapped
    assert _rss() - before < 0.1 * numel * 4
