"""What a failed attempt at a training step must not leave behind besides gradients: buffers the model updates
in training, and the random streams.

An attempt that runs out of memory half-way has already run some micro-batches forward: BatchNorm has folded
their statistics into `running_mean` / `running_var` and counted them in `num_batches_tracked` (issue 21:
43% off and 3 instead of 2 after one recovery). The re-run must start from the state the failed attempt
started from, so a recovered step equals a clean one at the new micro-batch. `fit` snapshots every
parameter and buffer to the host once per tune (`search/snapshot.py`); a training step cannot pay that
every step, so it copies, on the device, only the buffers that change in training:

- those of normalization layers that track running statistics (BatchNorm, InstanceNorm with
  `track_running_stats`): their kernels update `running_mean` and `running_var` in place without bumping
  the tensors' version counters, so they are known by module type;
- any other buffer whose version counter moved during an earlier step (an EMA, a step counter a
  module keeps with `add_`): learned after the first clean step.

The copies are a few bytes per channel (ResNet-50: about 53k values), made before each attempt.
"""

from __future__ import annotations

import torch
from torch import nn


class BufferGuard:
    """Copies of the buffers a step may update, and of the RNG states, taken with `save()` before an attempt
    and put back with `restore()` after one that failed."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.learned: set[int] = set()
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._versions: dict[int, int] = {}
        self._rng: tuple[torch.Tensor, list[torch.Tensor] | None] | None = None

    def save(self) -> None:
        """Before an attempt: copy what it may change."""
        buffers = list(self.model.buffers())
        watched = self.learned | {id(b) for m in self.model.modules() if _tracks_statistics(m)
                                  for b in m.buffers(recurse=False)}
        with torch.no_grad():
            self._saved = [(b, b.clone()) for b in buffers if id(b) in watched]
        self._versions = {id(b): b._version for b in buffers if id(b) not in watched}
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._rng = (torch.get_rng_state(), cuda)

    def restore(self) -> None:
        """After a failed attempt: every watched buffer and the RNG streams as `save()` found them."""
        with torch.no_grad():
            for live, saved in self._saved:
                live.copy_(saved)
        if self._rng is not None:
            cpu, cuda = self._rng
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)

    def learn(self) -> None:
        """After a clean attempt: watch from now on the buffers it changed that were not watched."""
        for b in self.model.buffers():
            if id(b) in self._versions and b._version != self._versions[id(b)]:
                self.learned.add(id(b))
        self._saved, self._versions = [], {}


def _tracks_statistics(module: nn.Module) -> bool:
    """A normalization layer whose forward in training updates running statistics in place."""
    return isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats
