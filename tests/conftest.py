"""Shared test set-up: the examples' small GPT on the path, one CPU thread per process, and GPU tests skipped
cleanly without a GPU."""

from __future__ import annotations

import gc
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

# One intra-op thread, here and (through the environment) in every process a test starts: the tests' models
# are too small to gain from a second thread, and on a small machine shared with other work torch's OpenMP
# threads wait on each other so long that a step takes up to ten times as long.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# The search measures bf16 on every CPU, here and in the processes tests start, as on a bf16 GPU: the tests
# check the search's decisions, which must not depend on whether this machine's CPU runs bf16 natively (a CPU
# plan otherwise stays in fp32 there). tests/test_cpu_bf16.py checks the default itself.
os.environ.setdefault("AUTOTUNE_CPU_BF16", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker: gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def heap_frozen_before_each_module() -> None:
    """What is alive when a test module starts (torch, transformers, the modules and fixtures before it) is set
    aside from Python's garbage collector (`gc.freeze`), so the full collections inside every `fit` walk only what
    the module's tests made. A worker process that has run many modules holds most of a million objects, and one
    full collection of them costs about 0.3 s on a 2-core machine: about a second of a tiny model's `fit`.
    Frozen objects are still freed by reference counting; cycles made inside a test are still collected."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def autotune_logger_as_found() -> Iterator[None]:
    """`autotune run` invoked in-process (click's test runner) gives the `autotune` logger its own handler and
    turns propagation off; put it back after each test, so a later test's caplog still sees autotune's records."""
    logger = logging.getLogger("autotune")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans go to a cache inside the test's directory (fit and recovery write to the default one), and
    $AUTOTUNE_TECHNIQUES from the environment does not narrow what the step allows. A module takes it with
    `pytestmark = pytest.mark.usefixtures("private_cache")`."""
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "plans.db"))
    monkeypatch.delenv("AUTOTUNE_TECHNIQUES", raising=False)


@pytest.fixture(autouse=True)
def compiling_left_as_found() -> Iterator[None]:
    """A test leaves no torch dispatch mode on the stack (a memory ceiling or a loss check's mode whose `with` never
    closed) and Dynamo's stance and switch as it found them: every later test in the process would run under
    them, and Dynamo compiles nothing under a mode, a "force_eager" stance or `config.disable`."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode

    before = len(_get_current_dispatch_mode_stack())
    stance = _dynamo_state()
    yield
    left = _get_current_dispatch_mode_stack()[before:]
    for _ in left:
        _pop_mode()
    assert not left, f"the test left dispatch modes on the stack: {left}"
    assert stance is None or _dynamo_state() == stance, f"the test left Dynamo {_dynamo_state()}, found {stance}"


def _dynamo_state() -> tuple[str, bool] | None:
    """Dynamo's stance and its `disable` switch, where this process loaded Dynamo (a test that loads it first
    finds it at its defaults)."""
    if "torch._dynamo" not in sys.modules:
        return None
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    stance = getattr(getattr(eval_frame, "_stance", None), "stance", "default")
    return str(stance), bool(torch._dynamo.config.disable)
