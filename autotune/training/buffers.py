"""What a failed attempt at a training step must not leave behind besides gradients: buffers the model updates
in training, and the random streams.

An attempt that runs out of memory half-way has already run some micro-batches forward: BatchNorm has folded
their statistics into `running_mean` / `running_var` and counted them in `num_batches_tracked`. The re-run must start
from the state the failed attempt started from, so a recovered step equals a clean one at the new micro-batch. `fit`
snapshots every parameter and buffer to the host once per tune (`search/snapshot.py`); a training step cannot pay that
every step, so it copies, on the device, only the buffers that change in training:

- those of normalization layers that track running statistics (BatchNorm, InstanceNorm with
  `track_running_stats`): their kernels update `running_mean` and `running_var` in place without bumping
  the tensors' version counters, so they are known by module type;
- any other buffer whose version counter moved during an earlier step (an EMA, a step counter a
  module keeps with `add_`): learned after the first clean step;
- a buffer the attempt reassigned (`self.steps = self.steps + 1`): the module gets back the tensor it had,
  which the attempt left as it was.

The copies are a few bytes per channel (ResNet-50: about 53k values), allocated once and refreshed before
each attempt with one multi-tensor copy (about 0.4 ms for 53 BatchNorm layers on one CPU core).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..techniques.forward_writes import tracks_statistics

log = logging.getLogger(__name__)

# A learned buffer (not a norm layer's) is copied every step only up to this share of the parameters'
# bytes: an EMA of the weights kept as buffers would otherwise double its device memory.
LEARNED_SHARE = 0.01


class BufferGuard:
    """Copies of the buffers a step may update, and of the RNG states, taken with `save()` before an attempt
    and put back with `restore()` after one that failed."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        # The random streams of the step's own device only: reading every GPU's from each rank of a job
        # would have each rank touch every card.
        self.cuda = device.type == "cuda"
        self.cuda_index = device.index
        self.learned: set[int] = set()
        self._live: list[torch.Tensor] = []  # the watched buffers, and their copies (kept: no allocation a step)
        self._copies: list[torch.Tensor] = []
        self._versions: dict[int, int] = {}
        self._slots: list[tuple[nn.Module, str, torch.Tensor]] = []  # each buffer's module, name and tensor
        self._rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._too_large: set[str] = set()
        self._limit = LEARNED_SHARE * sum(p.numel() * p.element_size() for p in model.parameters())

    def save(self) -> None:
        """Before an attempt: copy what it may change."""
        buffers = list(self.model.buffers())
        modules = list(self.model.modules())
        self._slots = [(m, name, b) for m in modules for name, b in m._buffers.items() if b is not None]
        norms = {id(b) for m in modules if tracks_statistics(m) for b in m.buffers(recurse=False)}
        watched = [b for b in buffers if id(b) in norms or id(b) in self.learned]
        self._copy(watched)
        ids = {id(b) for b in watched}
        self._versions = {id(b): b._version for b in buffers if id(b) not in ids}
        cuda = torch.cuda.get_rng_state(self._cuda_device()) if self.cuda else None
        self._rng = (torch.get_rng_state(), cuda)

    def _copy(self, watched: list[torch.Tensor]) -> None:
        same = len(watched) == len(self._live) and all(
            a is b and a.shape == c.shape for a, b, c in zip(watched, self._live, self._copies))
        with torch.no_grad():
            if same and watched:
                torch._foreach_copy_(self._copies, watched)  # one launch per dtype, not one per buffer
            elif not same:
                self._live, self._copies = watched, [b.clone() for b in watched]

    def restore(self) -> None:
        """After a failed attempt: every watched buffer and the RNG streams as `save()` found them."""
        for module, name, tensor in self._slots:
            if module._buffers.get(name) is not tensor:
                module._buffers[name] = tensor
        with torch.no_grad():
            if self._live:
                torch._foreach_copy_(self._live, self._copies)
        if self._rng is not None:
            cpu, cuda = self._rng
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, self._cuda_device())

    def _cuda_device(self) -> int:
        return self.cuda_index if self.cuda_index is not None else torch.cuda.current_device()

    def learn(self) -> None:
        """After a clean attempt: watch from now on the buffers it changed that were not watched."""
        for name, b in self.model.named_buffers():
            if id(b) not in self._versions or b._version == self._versions[id(b)]:
                continue
            if b.numel() * b.element_size() <= self._limit:
                self.learned.add(id(b))
            elif name not in self._too_large:
                self._too_large.add(name)
                log.warning("autotune: buffer %s changes in training but is too large to copy before every step "
                            "(over %.0f%% of the parameters' bytes); a step re-run after an OOM keeps the failed "
                            "attempt's update of it", name, 100 * LEARNED_SHARE)
        self._versions = {}
