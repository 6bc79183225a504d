"""The host-stepped engine of optimizer offload: a CPU optimizer (fused where torch has it) steps the FP32 host
masters on FP32 host gradients, serially after backward, or overlapped with the last backward by a worker
thread (`pipeline.py`). It serves what the streamed engine cannot: FP16 with a GradScaler (the unscale and inf
check run on the host gradients), any optimizer class, masters of mixed dtypes, and the serial step over FSDP2
shards. Its own buffers: the host gradients and, overlapped on CUDA, the pinned staging (`host_copies.py`), the
pipeline, and the optimizer views that step one chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...devices.ceiling import host_memory
from .engine import HostOptimizer
from .host_copies import HostCopies
from .pipeline import OffloadPipeline, chunk_indices, momentum_apart, optimizer_view, sync_view
from .shares import Shares
from .tensors import give_gradients, overlap_default


class HostSteppedEngine(HostOptimizer):
    """`step()` copies the device gradients into FP32 host gradients, steps the CPU optimizer over the masters,
    and copies the updated masters back into the device weights.

    With `overlap` (the default), the step's work starts during the last backward (`arm`, see pipeline.py);
    without it, all of it runs in `step()`. The two give the same parameters. `overlap` is the plan's (fit
    measured both ways); $AUTOTUNE_OFFLOAD_OVERLAP=0 turns it off regardless. Serial only: over FSDP2 shards
    (FSDP assigns their reduced gradients on its own stream after each block's reduce-scatter, not through the
    autograd accumulation the hooks follow, and sending a staged shard back fails there; the serial step writes
    each shard's master back in place), and partitioned over ranks (a rank that ran out of memory in its
    worker would leave the others waiting for its weights: the check-in guards the step, not the backward).
    """

    def __init__(self, shares: Shares, scaler: torch.amp.GradScaler | None = None, *,
                 overlap: bool | None = None) -> None:
        super().__init__(shares, scaler)
        give_gradients(shares.master)  # the CPU step reads FP32 host gradients
        self.copies = HostCopies(shares)
        self.pipeline: OffloadPipeline | None = None
        self._views: dict[tuple[int, ...], torch.optim.Optimizer] = {}
        if (overlap_default() and overlap is not False and shares.host_index and not shares.sharded
                and shares.partition is None):
            self._start_pipeline()

    def _start_pipeline(self) -> None:
        shares = self.shares
        cuda = shares.params[0].device.type == "cuda"
        stream = torch.cuda.Stream(shares.params[0].device) if cuda else None
        if cuda:
            self.copies.stage_through(stream)
        numels = [p.numel() for p in shares.params]
        self.pipeline = OffloadPipeline({i: shares.params[i] for i in shares.host_index},
                                        chunk_indices(shares.host_index, numels), self.copies.land, self._step_chunk,
                                        stream=stream, stage=self.copies.stage if cuda else None)

    def arm(self, defer: bool = False) -> None:
        """Start copying (and unless `defer` or a loss scale, stepping) during the last backward; a no-op
        without the pipeline."""
        if self.pipeline is not None:
            self.pipeline.arm(defer or self.scaler is not None)

    def abort(self) -> set[int]:
        """Chunks already stepped by the worker keep their update and are not stepped again; their positions."""
        if self.pipeline is not None:
            self.pipeline.abort()
            self.skip |= self._done()
        return set(self.skip)

    def _done(self) -> set[int]:
        """The positions of the chunks the worker stepped during backward."""
        pipeline = self.pipeline
        return {i for c in pipeline.done for i in pipeline.chunks[c]} if pipeline is not None else set()

    def _step_chunk(self, indices: list[int]) -> None:
        """The worker's step of one chunk whose gradients all landed (narrowed into staging, sent after backward)."""
        self._step_host(indices)
        if self.copies.staging:
            self.copies.narrow(indices)

    def _step_host(self, indices: Sequence[int]) -> None:
        key = tuple(indices)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = optimizer_view(self.shares.optimizer, [self.shares.master[i] for i in indices])
        sync_view(view)
        with host_memory():
            for part in momentum_apart(view):
                part.step()

    # -- the step ----------------------------------------------------------------------------------------
    def _prepare(self) -> set[int]:
        """The pipeline's work finished; the gradients it did not copy (and no earlier attempt stepped) copied."""
        pipeline = self.pipeline
        if pipeline is not None and pipeline.armed:
            try:
                pipeline.finish()
            except BaseException:
                pipeline.reset()
                raise
        landed = pipeline.landed - pipeline.refired if pipeline is not None else set()
        done = self._done()
        shares = self.shares
        self.copies.copy_grads([i for i in shares.host_index if i not in landed and i not in done
                                and i not in self.skip])
        if shares.params[0].device.type == "cuda" and shares.host_index:
            torch.cuda.synchronize(shares.params[0].device)  # the host gradients' copies have landed
        return done | self.skip

    def _host_grads(self, indices: list[int]) -> list[torch.Tensor]:
        return self.copies.live(indices)

    def _step_host_share(self, stepped: set[int], rest: list[int], factor: float) -> None:
        shares, copies = self.shares, self.copies
        if self.pipeline is None and not stepped:  # the serial step
            with host_memory():
                for part in momentum_apart(shares.optimizer):
                    part.step()
            copies.write_back([i for i in shares.host_index if shares.master[i].grad is not None])
            return
        staged = self._done()
        copies.send_back(sorted(staged))  # narrowed by the worker during backward
        copies.write_back(sorted(stepped - staged))  # stepped by an earlier attempt of this batch
        for chunk in self.pipeline.chunks if self.pipeline else [rest]:
            todo = [i for i in chunk if i not in stepped]
            if todo:  # (a master without a gradient this step is in the view, and skipped by its optimizer)
                self._step_host(todo)
                copies.write_back([i for i in todo if shares.master[i].grad is not None])
        copies.settle()  # the next forward waits for the weights sent back

    def _failed(self) -> None:
        """Nothing half done to undo: the weights go back only once the host share is stepped."""

    def _reset(self) -> None:
        if self.pipeline is not None:
            self.pipeline.reset()

    def _close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        self.copies.release()
        self._views = {}
