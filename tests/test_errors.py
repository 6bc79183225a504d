"""The OOM classifier against real exception objects."""

from __future__ import annotations

import signal

import pytest
import torch

from autotune.devices.ceiling import SimulatedCeiling
from autotune.errors import is_device_poisoned, is_host_oom_kill, is_oom, is_oom_text


def _raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the point is to capture what torch really raises
        return exc
    raise AssertionError("expected an exception")


def test_a_real_out_of_memory_error_is_an_oom():
    def allocate_past_ceiling():
        with SimulatedCeiling(1024):
            torch.zeros(4096)

    exc = _raised(allocate_past_ceiling)
    assert type(exc) is torch.OutOfMemoryError
    assert is_oom(exc)


def test_cpu_allocator_failure_is_an_oom():
    exc = _raised(lambda: torch.empty(2**62, dtype=torch.uint8))
    assert isinstance(exc, RuntimeError)
    assert is_oom(exc), str(exc)


@pytest.mark.parametrize("message", [
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
    "CUDA out of memory. Tried to allocate 2.00 GiB",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
    "CUDA error: out of memory (cudaHostAlloc for pin_memory)",
])
def test_known_runtime_messages_are_ooms(message):
    assert is_oom(RuntimeError(message))
    assert is_oom_text(f"Traceback ...\nRuntimeError: {message}")


def test_a_value_error_mentioning_out_of_memory_is_not_an_oom():
    assert not is_oom(ValueError("CUDA out of memory"))
    assert not is_oom(TypeError("out of memory"))
    assert not is_oom(KeyError("CUDA out of memory"))


def test_other_runtime_errors_are_not_ooms():
    exc = _raised(lambda: torch.ones(2, 3) @ torch.ones(4, 5))
    assert not is_oom(exc)
    assert not is_oom(RuntimeError("Expected all tensors to be on the same device"))


def test_device_side_assert_is_poison_not_oom():
    exc = RuntimeError("CUDA error: device-side assert triggered\nout of memory")
    assert not is_oom(exc)
    assert is_device_poisoned(exc)
    assert not is_oom_text("RuntimeError: CUDA error: an illegal memory access was encountered")


def test_sigkill_without_result_is_a_host_memory_suspect():
    assert is_host_oom_kill(-signal.SIGKILL, wrote_result=False)
    assert not is_host_oom_kill(-signal.SIGKILL, wrote_result=True)
    assert not is_host_oom_kill(1, wrote_result=False)
