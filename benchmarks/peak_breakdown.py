"""Who holds a CUDA step's peak: the blocks live at the allocator's highest point, grouped by what made them.

`Recorder` turns on the caching allocator's history (`torch.cuda.memory._record_memory_history`, Python
frames) around a few steps and keeps the snapshot. `at_peak(snapshot, before)` replays the device's trace of
allocations and frees, finds the point where the allocated total was highest, and sums the blocks live there
by owner: the first rule of `OWNERS` that one of the block's frames matches (FSDP's all-gather and
reduce-scatter, the optimizer's step, the loss, autograd's backward), else "forward and other". Blocks that
existed before recording began (weights, gradients and optimizer state of earlier steps) are `before`; the
reserved bytes at the same point, less the allocated, are the allocator's cache and fragmentation.

    with Recorder() as rec:
        train_a_few_steps()
    print(rec.breakdown)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Frame = dict[str, Any]

# (owner, does a frame belong to it): checked in this order against every frame of a block's stack.
OWNERS: list[tuple[str, Callable[[Frame], bool]]] = [
    ("FSDP all-gather", lambda f: "_fsdp" in f["filename"] and "all_gather" in f["name"]),
    ("FSDP reduce-scatter", lambda f: "_fsdp" in f["filename"] and "reduce_scatter" in f["name"]),
    ("optimizer step", lambda f: "/torch/optim/" in f["filename"] or "/offload/" in f["filename"]),
    ("loss", lambda f: "chunked_loss" in f["filename"] or "cross_entropy" in f["name"]),
    ("backward", lambda f: f["name"] == "backward" or "/torch/autograd/" in f["filename"]),
]
OTHER = "forward and other"


def owner(frames: list[Frame]) -> str:
    """The owner of a block allocated under `frames` (innermost first, as the allocator records them)."""
    for name, belongs in OWNERS:
        if any(belongs(f) for f in frames):
            return name
    return OTHER


def at_peak(snapshot: dict[str, Any], before: int, device: int = 0) -> dict[str, Any]:
    """The allocated peak of `snapshot`'s trace on `device` and what was live there, by owner (bytes).

    `before` is the allocated total when recording began (what the trace does not see allocated).
    """
    live: dict[int, tuple[int, str]] = {}
    allocated = best = before
    reserved = reserved_at_best = 0
    at_best: dict[int, tuple[int, str]] = {}
    for event in snapshot["device_traces"][device]:
        if "addr" not in event:  # an "oom" or "snapshot" mark: no block of its own
            continue
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, owner(event.get("frames") or []))
            allocated += size
            if allocated > best:
                best, at_best, reserved_at_best = allocated, dict(live), reserved
        elif action == "free_completed" and addr in live:
            allocated -= live.pop(addr)[0]
        elif action in ("segment_alloc", "segment_map"):
            reserved += size
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
    by_owner: dict[str, int] = {"before the steps": before}
    for size, who in at_best.values():
        by_owner[who] = by_owner.get(who, 0) + size
    return {"peak_allocated": best, "by_owner": by_owner, "segments_added_by_peak": reserved_at_best}


class Recorder:
    """Records the allocator's history while inside; `breakdown` is `at_peak` of it afterwards."""

    def __init__(self, max_entries: int = 1_000_000) -> None:
        self.max_entries = max_entries
        self.breakdown: dict[str, Any] = {}
        self._before = 0

    def __enter__(self) -> Recorder:
        torch.cuda.synchronize()
        self._before = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=self.max_entries, stacks="python")
        return self

    def __exit__(self, *exc: Any) -> None:
        try:  # recording stops whatever happened inside, or every later allocation would be recorded too
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        self.breakdown = at_peak(snapshot, self._before, torch.cuda.current_device())


class PhasePeaks:
    """The allocated peak of each phase of the steps run inside, and what was allocated when each phase began.

    Read at the model's forward hooks and the optimizer's step hooks, resetting the allocator's peak at each:
    a phase is "forward", "backward" (from a forward's end to the next forward or the optimizer step) or
    "optimizer step"; under optimizer offload, where the optimizer given is not the one stepped, backward runs
    to the next forward. Coarser than `Recorder`, and it records no Python stacks (recording them has failed
    inside recomputed blocks with a SystemError from dropout).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.peaks: dict[str, int] = {}
        self.at_start: dict[str, int] = {}
        self._phase = "before"
        self._handles: list[Any] = []

    def _close(self, ended: str, begins: str) -> None:
        torch.cuda.synchronize()
        if ended == self._phase:
            self.peaks[ended] = max(self.peaks.get(ended, 0), torch.cuda.max_memory_allocated())
        self.at_start[begins] = max(self.at_start.get(begins, 0), torch.cuda.memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        self._phase = begins

    def __enter__(self) -> PhasePeaks:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self._handles = [
            self.model.register_forward_pre_hook(lambda *_: self._close(self._phase, "forward")),
            self.model.register_forward_hook(lambda *_: self._close("forward", "backward")),
            self.optimizer.register_step_pre_hook(lambda *_: self._close("backward", "optimizer step")),
            self.optimizer.register_step_post_hook(lambda *_: self._close("optimizer step", "after the step")),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()

    @property
    def breakdown(self) -> dict[str, Any]:
        return {"peak_by_phase": self.peaks, "allocated_at_phase_start": self.at_start}
