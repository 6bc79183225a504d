"""What the agent measures inside a job: whole optimizer steps (and the optimizer's share of them), and peak memory.

A step is timed from the end of one `optimizer.step()` to the end of the next, with global optimizer hooks,
so it holds everything a training loop does for one update: data, forward, backward, clipping, the
optimizer, the scheduler, logging. Timing only the gap between two `step()` calls ("compute") broke on
Lightning, which runs forward and backward inside `optimizer.step(closure)`: the gap was near zero, and
the plan's claim many times what the run trained at.

The optimizer's own share is the `step()` call less the time spent in the closure it was handed (the
pre-step hook wraps the closure in a timer); without a closure it is the whole call. Manual optimization
(the loop calls `step()` itself, any closure a no-op) and schedulers (stepped after the optimizer) need
nothing special: they fall between two step ends like any other work.

The clock: on CUDA, wall time once the device is synchronised. On the CPU under the simulated ceiling,
the process's CPU time (all its threads): the simulated device models a GPU's memory, not its speed, and
the host is shared; on the two-core test machine, wall times of one configuration in one tune differed
2x (74 and 148 ms a step, Lightning, tiny GPT) with other jobs running, while CPU time does not charge
the neighbours' share to the plan. Trials and the real run use the same clock, so claims compare.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import settings

MAX_KEPT_STEPS = 10_000  # a real run keeps its last this many step times (80 KiB of floats), for the median


def clock(device: str) -> Callable[[], float]:
    """The step clock for `device` ("cuda" or "cpu"); see the module docstring."""
    return time.process_time if device == "cpu" else synchronized_now


def synchronized_now() -> float:
    """`perf_counter` once queued CUDA work is done (a step's kernels run asynchronously)."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def process_age() -> float | None:
    """Seconds since `autotune run` launched this trial ($AUTOTUNE_AGENT_LAUNCHED, on the same wall clock; the
    kernel's start time of the process is only as fine as the boot time's whole seconds), or None outside a
    trial. Read at the first step, it holds the interpreter, the imports, building the model and data, and
    that first step."""
    launched = settings.read(settings.AGENT_LAUNCHED_ENV)
    return max(0.0, time.time() - float(launched)) if launched else None


class StepWatch:
    """Counts and times whole optimizer steps through global hooks; see the module docstring.

    Only the outermost `step()` of the first optimizer seen counts as a training step: a wrapper that
    steps an inner optimizer (Accelerate's, where it is hooked) or a second optimizer (a GAN's
    discriminator) falls inside the step being timed. Steps taken on other threads (autotune's own
    optimizer offload steps host chunks on a worker during backward) are inside it too, and ignored:
    the training loop steps from the thread that installed the watch. The first step is not measured:
    it builds the optimizer state and, in most loops, warms the data loader.

    Args:
        on_step: called after each counted step with the watch (a trial stops the process from there).
        now: the clock (`clock(device)`).
    """

    def __init__(self, on_step: Callable[[StepWatch], None] | None = None,
                 now: Callable[[], float] = synchronized_now) -> None:
        self.on_step = on_step
        self.now = now
        self.count = 0
        self.step_seconds: collections.deque[float] = collections.deque(maxlen=MAX_KEPT_STEPS)  # whole steps
        self.optimizer_seconds: collections.deque[float] = collections.deque(maxlen=MAX_KEPT_STEPS)
        self.closure_steps = 0  # measured steps whose forward and backward ran inside step(closure)
        self._primary: int | None = None  # id() of the optimizer whose steps count
        self._depth = 0  # nesting of step() calls in progress
        self._outermost: int | None = None  # id() of the optimizer whose step() opened the nesting
        self._entered = 0.0  # when the outermost step() began
        self._in_closure = 0.0  # seconds spent in its closure so far
        self._last_end: float | None = None
        self._handles: list[Any] = []
        self._thread = threading.get_ident()
        self.startup_seconds: float | None = None  # from the trial's launch to the end of its first step

    def install(self) -> None:
        """Hook every optimizer of the process, present and future."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._thread = threading.get_ident()
        self._handles = [register_optimizer_step_pre_hook(self._before_step),
                         register_optimizer_step_post_hook(self._after_step)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def restart(self) -> None:
        """Forget every step so far (fit's trials, before the plan's own training starts)."""
        self.count, self.closure_steps, self._primary, self._last_end = 0, 0, None, None
        self.step_seconds.clear()
        self.optimizer_seconds.clear()

    # -- hooks ---------------------------------------------------------------------------------------------
    def _before_step(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if threading.get_ident() != self._thread:
            return None
        if self._depth and id(optimizer) == self._outermost:
            self._depth = 0  # its last step() raised (and the loop went on): no post hook closed it
        self._depth += 1
        if self._depth > 1:
            return None
        self._outermost = id(optimizer)
        self._in_closure = 0.0
        self._entered = self.now()
        # args[0] is the optimizer itself; a closure comes as step(closure) or step(closure=...).
        if callable(kwargs.get("closure")):
            return args, {**kwargs, "closure": self._timed(kwargs["closure"])}
        if len(args) > 1 and callable(args[1]):
            return (args[0], self._timed(args[1]), *args[2:]), kwargs
        return None

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        self._depth = max(0, self._depth - 1)
        if self._depth:
            return
        if self._primary is None:
            self._primary = id(optimizer)
        if id(optimizer) != self._primary:
            return  # another optimizer's step: part of the primary's whole step
        now = self.now()
        if self._last_end is not None:
            self.step_seconds.append(now - self._last_end)
            self.optimizer_seconds.append(max(0.0, now - self._entered - self._in_closure))
            self.closure_steps += self._in_closure > 0
        self._last_end = now
        self.count += 1
        if self.count == 1:
            self.startup_seconds = process_age()
        if self.on_step is not None:
            self.on_step(self)

    def _timed(self, closure: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self.now()
            try:
                return closure(*args, **kwargs)
            finally:
                self._in_closure += self.now() - start
        return timed

    # -- what is reported ------------------------------------------------------------------------------------
    def trial_record(self, peak_bytes: int, alloc_retries: int) -> dict[str, Any]:
        """A zero-change trial's measurements: per measured step, the micro-step (whole step less the
        optimizer's share; a trial runs at accumulation 1) and the optimizer's share."""
        whole, optimizer = list(self.step_seconds), list(self.optimizer_seconds)
        return {"steps": self.count, "step_seconds": [w - o for w, o in zip(whole, optimizer)],
                "optimizer_seconds": optimizer, "whole_step_seconds": whole, "closure_steps": self.closure_steps,
                "peak_bytes": peak_bytes, "alloc_retries": alloc_retries, "startup_seconds": self.startup_seconds}

    def run_record(self) -> dict[str, Any] | None:
        """The real run's measurement: how many steps, and the median whole step of those measured."""
        if not self.step_seconds:
            return None
        return {"steps": self.count, "measured_steps": len(self.step_seconds),
                "median_step_seconds": statistics.median(self.step_seconds),
                "mean_step_seconds": statistics.fmean(self.step_seconds)}


class PeakMeter:
    """The job's peak memory: the simulated ceiling's count on the CPU, the caching allocator's on CUDA."""

    def __init__(self, ceiling: Any = None) -> None:
        self.ceiling = ceiling
        self._retries0 = 0

    def reset(self) -> None:
        import torch

        if self.ceiling is not None:
            self.ceiling.reset_peak()
        elif torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
            self._retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)

    def read(self) -> tuple[int, int]:
        """(peak bytes, allocator retries since `reset`)."""
        import torch

        if self.ceiling is not None:
            return self.ceiling.peak_bytes, 0
        if not torch.cuda.is_initialized():
            return 0, 0
        from ..devices.placement import outside_allocator_bytes

        index = torch.cuda.current_device()
        retries = torch.cuda.memory_stats(index).get("num_alloc_retries", 0) - self._retries0
        # Reserved, plus what the allocator does not see (context, workspaces): a real card of this size holds both.
        return torch.cuda.max_memory_reserved(index) + outside_allocator_bytes(index), retries
