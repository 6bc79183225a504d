"""Overlapped optimizer offload: the host optimizer steps while the last backward is still running.

Serial optimizer offload waits for the whole backward, copies every gradient to the host, steps every
parameter on the CPU and copies every weight back while the GPU idles. Here, during the last micro-batch's
backward (the step `arm()`s the pipeline just before it):

1. a post-accumulate-grad hook fires as each parameter's gradient becomes final and copies it, on a side
   CUDA stream, into a pinned 16-bit staging buffer (2 bytes a parameter over PCIe, no FP32 copy on the GPU);
2. a worker thread waits for each copy's event, widens it into the FP32 host gradient, and steps the CPU
   optimizer (fused AdamW where torch has it) on a chunk as soon as every gradient of the chunk has landed;
   the updated masters are narrowed into the same staging buffers;
3. after backward the step copies the staged weights back (host to device, on the side stream) and steps
   only what is left: the chunks whose gradients landed last, and those holding a parameter that got no
   gradient this step (the optimizer skips that one, as torch's does: no weight decay, moments or step count).

Exact, not a delayed update: each chunk is stepped once with its final gradient, by the same per-parameter
optimizer arithmetic as the serial step (torch's built-in optimizers are elementwise per parameter, so
stepping them chunk by chunk gives bitwise the same result). Where a gradient can still change after it is
final in backward (gradient clipping over the whole batch, a GradScaler's inf check, a user callback
before the step, a token-count correction, several ranks reducing gradients), the step arms the pipeline
with `defer=True`: the copies still overlap backward, but no chunk is stepped until the step says so.

Weights go back to the device only after backward: a parameter's gradient being final does not promise that
backward reads its weight no more (a weight used through `.detach()`), and an OOM later in the same backward
re-runs the batch (training/step.py) with the old weights on the device. Chunks already stepped then keep
their update and are not stepped again (`abort`): each was stepped with the whole batch's gradient at the
old weights, which is what the re-run computes for them.

Why not torchao's `CPUOffloadOptimizer` (checked, torchao 0.18): it asserts a CUDA or XPU device (the CPU
test device could not run it), keeps the host master in the device weight's dtype (no 16-bit weights beside
FP32 masters, which is the memory this rung saves), copies on every micro-batch's backward, and steps the
CPU optimizer only inside `step()` after backward: it overlaps the copies, not the CPU step. Megatron-Core's
`HybridDeviceOptimizer` and DeepSpeed's ZeRO-Offload likewise overlap the transfers with the CPU step after
backward (DeepSpeed's overlapped variant is a one-step-delayed update, which changes the result).

On the simulated CPU device there are no streams: the hook only queues the parameter and the worker reads
the final gradient itself. The worker thread runs no simulated ceiling (dispatch modes are per thread), which
is right: everything it allocates is host memory.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...devices.ceiling import SimulatedCeiling, active_ceiling, counting_host_on_this_thread

CHUNK_ELEMENTS = 1 << 24  # 16 Mi parameters (64 MiB of FP32 masters) per chunk: large enough to keep the fused
# CPU kernel efficient, small enough that the first chunk is stepped early in backward


def chunk_indices(indices: Sequence[int], numels: Sequence[int], limit: int | None = None) -> list[list[int]]:
    """Split host-parameter positions into chunks of about `limit` elements (default `CHUNK_ELEMENTS`),
    last parameters first (backward reaches them first)."""
    limit = CHUNK_ELEMENTS if limit is None else limit
    chunks: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in reversed(indices):
        current.append(i)
        size += numels[i]
        if size >= limit:
            chunks.append(current)
            current, size = [], 0
    if current:
        chunks.append(current)
    return chunks


def optimizer_view(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """An optimizer stepping only `params`, sharing `optimizer`'s state and hyperparameters (re-read by
    `sync_view` before each step). A shallow copy: the same class, so the same step arithmetic."""
    keep = {id(p) for p in params}
    view = copy.copy(optimizer)
    view.param_groups = [dict(g, params=[p for p in g["params"] if id(p) in keep]) for g in optimizer.param_groups]
    view.param_groups = [g for g in view.param_groups if g["params"]]
    view._owner_groups = [g for g in optimizer.param_groups if any(id(p) in keep for p in g["params"])]  # type: ignore[attr-defined]
    return view


def momentum_apart(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """`optimizer`, or two views of it to step one after the other where one call cannot step it as torch's
    loop would: torch's fused SGD starts every momentum buffer of a call from its gradient or none (a single
    `is_first_step`), and refuses a call that mixes parameters with a buffer and parameters at their first
    gradient (a head used from a later step on). The loop form starts each parameter's buffer on its own, so
    the fresh ones go in a second call."""
    fresh: list[torch.Tensor] = []
    rest: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        if not (group.get("fused") and group.get("momentum", 0) != 0):
            rest += group["params"]
            continue
        for p in group["params"]:
            started = optimizer.state.get(p, {}).get("momentum_buffer") is not None
            (fresh if p.grad is not None and not started else rest).append(p)
    if not fresh or not any(p.grad is not None for p in rest):
        return [optimizer]
    return [optimizer_view(optimizer, rest), optimizer_view(optimizer, fresh)]


def sync_view(view: torch.optim.Optimizer) -> None:
    """Copy lr, betas, weight decay... from the groups the view was cut from (an LR scheduler writes there)."""
    for mine, owner in zip(view.param_groups, view._owner_groups):  # type: ignore[attr-defined]
        for key, value in owner.items():
            if key != "params":
                mine[key] = value


class OffloadPipeline:
    """The hooks, side stream and worker thread of one `HostSteppedEngine` (see the module docstring).

    Large: the gradient hooks, the worker thread and the step write and read one step's bookkeeping (which
    gradients landed, which chunks are pending or stepped, whether the attempt was aborted or a gradient grew
    after it was final); they stay in one object so that bookkeeping has one owner across the autograd hooks
    and the worker thread.

    Args:
        params: the device parameters whose masters live on the host, by trainable index.
        land: `land(i)` moves parameter i's final gradient into its FP32 host gradient (worker thread).
        step_chunk: `step_chunk(indices)` steps those masters and stages their weights (worker thread).
        chunks: host positions per chunk, in the order backward is expected to finish them.
        stream: the side CUDA stream for the copies, None on the simulated device.
        stage: `stage(i, grad)` starts the device-to-host copy of a final gradient on `stream`.
    """

    def __init__(self, params: dict[int, torch.nn.Parameter], chunks: list[list[int]],
                 land: Callable[[int], None], step_chunk: Callable[[list[int]], None],
                 stream: Any = None, stage: Callable[[int, torch.Tensor], None] | None = None) -> None:
        self.chunks = chunks
        self._chunk_of = {i: c for c, chunk in enumerate(chunks) for i in chunk}
        self._land = land
        self._step_chunk = step_chunk
        self._stream = stream
        self._stage = stage
        self.armed = False
        self.defer = False
        self.landed: set[int] = set()  # host positions whose gradient reached the host this step
        self.done: set[int] = set()  # chunks stepped: kept across an aborted attempt (see `abort`)
        self.chunks_stepped = 0  # by the worker, since this pipeline started: what the benchmark reports
        self.refired: set[int] = set()  # positions whose gradient grew after it was taken (see `_refired`)
        self.disabled = False  # no more overlap for this optimizer: a gradient once grew after it was final
        self._pending = [0] * len(chunks)  # gradients still missing per chunk
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._worker: threading.Thread | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._hook_for(i)) for i, p in params.items()]

    # -- the step's side --------------------------------------------------------------------------------
    def arm(self, defer: bool) -> None:
        """The next backward is the last of this optimizer step: copy (and unless `defer`, step) as it goes."""
        if self.disabled:
            return
        self._ensure_worker()
        self.armed, self.defer = True, defer
        self.landed = set()
        self.refired = set()
        self._pending = [0 if c in self.done else len(chunk) for c, chunk in enumerate(self.chunks)]

    def drain(self) -> None:
        """Wait until the worker has handled everything queued so far; re-raise what it raised."""
        if self._worker is not None:
            flushed = threading.Event()
            self._queue.put(flushed)
            flushed.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def abort(self) -> None:
        """The armed attempt failed (an OOM): stop copying, keep the chunks already stepped (`done`)."""
        self.armed = False
        try:
            self.drain()
        finally:
            self.landed = set()
            self.refired = set()

    def finish(self) -> None:
        """After backward: let the worker finish what landed (stepping the chunks it completes), then
        `landed` and `done` say what the step still has to do."""
        try:
            self.drain()
        finally:
            self.armed = False
        early = sorted(i for i in self.refired if self._chunk_of[i] in self.done)
        if early:
            raise RuntimeError(
                f"autotune: overlapped optimizer offload stepped parameter(s) {early} on a gradient that grew "
                "again later in the same backward (a weight shared by several regions of reentrant activation "
                "checkpointing, use_reentrant=True). Use use_reentrant=False, or set AUTOTUNE_OFFLOAD_OVERLAP=0 "
                "for the serial optimizer offload.")

    def reset(self) -> None:
        """The optimizer step is complete: forget this step's bookkeeping."""
        self.armed = False
        self.landed = set()
        self.refired = set()
        self.done = set()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.stop_worker()

    def stop_worker(self) -> None:
        """End the worker thread; the next `arm` starts another, which counts its host memory in the simulated
        ceiling in force then (a trial's own: see `search.kept_rung`)."""
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._worker = None

    # -- backward's side ----------------------------------------------------------------------------------
    def _hook_for(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if not self.armed or self._chunk_of[i] in self.done and i not in self.landed or p.grad is None:
                return
            if i in self.landed:
                self._refired(i)
                return
            self.landed.add(i)
            event = None
            if self._stream is not None and self._stage is not None:
                # The gradient was produced on backward's current stream: the copy waits for it, on the side.
                self._stream.wait_stream(torch.cuda.current_stream(p.device))
                with torch.cuda.stream(self._stream):
                    self._stage(i, p.grad)
                    event = torch.cuda.Event()
                    event.record(self._stream)
            self._queue.put((i, event))

        return hook

    def _refired(self, i: int) -> None:
        """A gradient taken as final grew again in the same backward: a weight shared by two regions of
        reentrant checkpointing (`use_reentrant=True`), whose nested backwards each accumulate it. The step
        copies it again after backward, no chunk is stepped during backward from now on (`disabled`), and
        if its chunk was stepped already the step fails (`finish`) rather than train on part of a gradient."""
        self.defer = True
        self.disabled = True
        self.refired.add(i)

    # -- the worker thread --------------------------------------------------------------------------------
    def _ensure_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, args=(active_ceiling(),),
                                            name="autotune-host-optimizer", daemon=True)
            self._worker.start()

    def _work(self, ceiling: SimulatedCeiling | None) -> None:
        with counting_host_on_this_thread(ceiling):  # on the simulated device: host memory, counted as such
            self._serve()

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            if self._error is not None:
                continue  # the step re-raises the first error; drop the rest of this attempt's work
            try:
                self._handle(*item)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread by drain()
                self._error = exc

    def _handle(self, i: int, event: Any) -> None:
        if event is not None:
            event.synchronize()
        self._land(i)
        c = self._chunk_of[i]
        self._pending[c] -= 1
        if self._pending[c] == 0 and not self.defer and self.armed:
            self._step_chunk(self.chunks[c])
            self.done.add(c)
            self.chunks_stepped += 1
