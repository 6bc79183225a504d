"""autotune's error types, and `is_oom`: the one place that decides what an out-of-memory error is."""

from __future__ import annotations

import signal

import torch


class AutotuneError(Exception):
    """Base of every error autotune raises on purpose."""


class InvalidSetting(AutotuneError, ValueError):
    """A setting is wrong; the message names it and says what to pass instead."""


class NoFeasiblePlan(AutotuneError):
    """Nothing fits, even at micro-batch 1 on the top rung allowed."""

    def __init__(self, message: str, trials: tuple = ()) -> None:
        super().__init__(message)
        self.trials = trials


class DeviceError(AutotuneError):
    """A CUDA error that is not an OOM; the CUDA context is unusable and the process must be restarted."""


class RankDied(AutotuneError):
    """A rank of a distributed job stopped answering in a collective: named by node, local rank and host."""


class TooFewSamples(AutotuneError):
    """A trial at micro-batch 1 failed because the model's batch statistics need more samples (internal:
    the search raises its smallest micro-batch and goes on; see `needs_more_samples`)."""


# Substrings of OOM messages libraries print. Matched case-sensitively: each is the
# exact text a library prints, and a loose match would turn unrelated errors into retries.
_OOM_MESSAGES = (
    "CUDA out of memory",
    "CUDA error: out of memory",  # CUDA 12.4+ raises this through a plain RuntimeError
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN's answer when it cannot get its workspace
    "DefaultCPUAllocator: can't allocate memory",
)

# Pinned host allocations fail with these while the GPU itself may be empty.
_PINNED_MESSAGES = (
    "cudaHostAlloc",
    "CachingHostAllocator",
    "pin_memory",
)

# Errors after which the CUDA context is poisoned: only a new process recovers.
_POISON = (
    "device-side assert triggered",
    "an illegal memory access was encountered",
    "illegal instruction",
    "unspecified launch failure",
    "misaligned address",
)


def is_oom(exc: BaseException) -> bool:
    """True when `exc` means a device (or pinned host) memory allocation failed.

    Class first (`torch.OutOfMemoryError`), then the message table, and only for the exception types
    that libraries actually raise OOMs through (`RuntimeError`, `MemoryError`). A `ValueError` that merely
    mentions "out of memory" is not an OOM.
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, MemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    if any(p in text for p in _POISON):
        return False
    if any(m in text for m in _OOM_MESSAGES):
        return True
    return "out of memory" in text and any(p in text for p in _PINNED_MESSAGES)


# What torch's batch norm raises when a channel would be normalized over a single value (BatchNorm1d on
# one sample, BatchNorm2d on one sample of a 1x1 map): the model cannot train on that micro-batch at all.
_BATCH_STATISTICS = "Expected more than 1 value per channel when training"


def needs_more_samples(exc: BaseException) -> bool:
    """True when `exc` says the micro-batch held too few samples for the model's batch statistics."""
    return isinstance(exc, ValueError) and _BATCH_STATISTICS in str(exc)


def is_device_poisoned(exc: BaseException) -> bool:
    """True when `exc` is a CUDA error that leaves the context unusable (device-side assert, bad address)."""
    return isinstance(exc, RuntimeError) and any(p in str(exc) for p in _POISON)


def is_oom_text(text: str) -> bool:
    """The classifier applied to a child's stderr or result file, where only the text survives."""
    if any(p in text for p in _POISON):
        return False
    if "torch.OutOfMemoryError" in text or "torch.cuda.OutOfMemoryError" in text:
        return True
    return any(m in text for m in _OOM_MESSAGES)


def is_host_oom_kill(returncode: int | None, wrote_result: bool) -> bool:
    """A child killed by SIGKILL that left no result is a host-memory (kernel OOM killer) suspect."""
    return returncode == -signal.SIGKILL and not wrote_result
