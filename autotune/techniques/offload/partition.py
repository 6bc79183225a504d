"""Optimizer offload on replicated ranks: each rank steps 1/world of the parameters (ZeRO stage 1).

Replicated, every rank holds the same summed gradients after the all-reduce, so every rank stepping every
parameter repeats one update world times: each rank would stream the same FP32 state over its own link
every step and keep the same FP32 masters and moments of the device share. Partitioned, each share of
optimizer offload (host and device: shares.py) is cut into `world` contiguous runs of parameters, balanced by
elements; rank r keeps masters and state for its runs only and steps them; then each rank broadcasts the
weights it updated to the others (16 bits a parameter: what DDP's all-reduce moves, over NVLink, against 24
bytes a parameter over each rank's PCIe link for the streamed state). The host work, host memory and
device-share state per rank fall to 1/world.

The update is the unpartitioned one, bitwise: the same kernel on the same gradient and state, run by one rank
instead of all (tests/test_offload_partition.py). What changes for the user: the optimizer state is spread
over the ranks, so `optimizer.state_dict()` gathers it, a collective that every rank must call (as with
FSDP's or ZeRO's optimizer state); closing the step gathers the state and the FP32 weights the same way.

Asked for by the plan's `sharding="optimizer_state"` (`apply_rung`), the engine runs with a host share of 0:
every master stays on the device and only the device share is partitioned, so a rank holds 16-bit weights and
gradients and 1/world of the FP32 masters and state (ZeRO stage 1 on the GPU; `fit` prices it after its pick,
search/partitioned_state.py).

Not partitioned: FSDP2 shards (sharded already), FP16 with a GradScaler (its inf check would need the
ranks' gradients again), one process, or $AUTOTUNE_OFFLOAD_PARTITION=0 (every rank steps everything, kept
for comparison: benchmarks/bench_multi_gpu.py measures both).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ... import settings
from ...parallel import broadcast_together, check_in

EVERY = -1  # the owner of a parameter every rank steps


def wanted() -> bool:
    """$AUTOTUNE_OFFLOAD_PARTITION: unset or 1 partitions on replicated ranks, 0 steps everything on every rank."""
    return settings.switch(settings.OFFLOAD_PARTITION_ENV)


def partitions(precision: str, sharded: bool) -> bool:
    """Whether optimizer offload of this kind partitions its shares over replicated ranks, where there are
    several: not over FSDP2 shards, under FP16's GradScaler, or with $AUTOTUNE_OFFLOAD_PARTITION=0."""
    return wanted() and not sharded and precision != "fp16"


def ranks(precision: str, sharded: bool) -> int:
    """Over how many ranks optimizer offload of this kind partitions its shares (1: not partitioned).
    `Shares` decides the same from what it is given; the search asks before building one."""
    if not partitions(precision, sharded) or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def runs(indices: Sequence[int], numels: Sequence[int], world: int) -> list[list[int]]:
    """`indices` (in order) cut into `world` consecutive runs of about equal elements; none empty when
    there are at least `world` indices."""
    total = sum(numels[i] for i in indices)
    out: list[list[int]] = [[] for _ in range(world)]
    r, held = 0, 0
    for k, i in enumerate(indices):
        left = len(indices) - k  # this index and the ones after it
        past_share = held + numels[i] / 2 > (r + 1) * total / world
        if r < world - 1 and out[r] and (past_share or left <= world - 1 - r):
            r += 1
        out[r].append(i)
        held += numels[i]
    return out


class Gathered:
    """What this rank holds of the parameters other ranks step, gathered from them: their optimizer state
    (`Partition.gather_state`), which stands in for their optimizer where `Shares.owners()` names one (it has a
    `state`, keyed by parameter, as an optimizer's is), and their full-precision weights while a model state
    dict is built (`Partition.gather_masters`; None otherwise)."""

    def __init__(self) -> None:
        self.state: dict[torch.Tensor, dict[str, Any]] = {}
        self.weights: dict[int, torch.Tensor] | None = None


class Partition:
    """Which rank steps which parameter, and the collectives that make the ranks whole again.

    Args:
        shares: the host share's and the device share's parameter positions (each cut into runs on its own,
            so that both the link time and the device memory are balanced).
        numels: elements of every parameter, by position.
    """

    def __init__(self, shares: Sequence[Sequence[int]], numels: Sequence[int]) -> None:
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.owner: dict[int, int] = {}  # EVERY: a share too small to cut, stepped by every rank as before
        for share in shares:
            if len(share) < self.world:
                self.owner.update({i: EVERY for i in share})
                continue
            for r, run in enumerate(runs(share, numels, self.world)):
                self.owner.update({i: r for i in run})
        self.device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
                       else torch.device("cpu"))

    def mine(self, indices: Sequence[int]) -> list[int]:
        """Those of `indices` this rank steps."""
        return [i for i in indices if self.owner[i] in (self.rank, EVERY)]

    def of(self, rank: int) -> list[int]:
        """The positions `rank` alone steps, in order."""
        return sorted(i for i, r in self.owner.items() if r == rank)

    # -- after each step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def share_weights(self, params: Sequence[torch.Tensor]) -> None:
        """Every rank's updated device weights to every other rank, in place (each parameter broadcast from
        its owner, under NCCL all in one group; no temporary, so no rank can run out of memory half-way through).

        In a trial (and a plan's first steps) a rank may have run out of memory before it got here and
        wait for the others elsewhere: the check-in first (`parallel.check_in`) raises an OOM on every
        rank that meets it then, instead of leaving it in a broadcast the failed rank never joins. Outside
        those, an OOM in the optimizer step ends the job (TrainingStep does not recover from one).
        """
        check_in()
        pairs = [(params[i].data, owner) for i, owner in sorted(self.owner.items()) if owner != EVERY]
        direct = [(t, src) for t, src in pairs if self._direct(t)]
        if direct:
            broadcast_together(direct).wait()
        for t, src in pairs:
            if not self._direct(t):
                self._broadcast(t, src)

    def _direct(self, t: torch.Tensor) -> bool:
        """Whether the backend can broadcast `t` in place (on its device, contiguous)."""
        return t.device == self.device and t.is_contiguous()

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        if self._direct(t):
            dist.broadcast(t, src)
            return
        moved = t.to(self.device).contiguous()  # a host tensor under NCCL, or a device tensor under gloo
        dist.broadcast(moved, src)
        if self.rank != src:
            t.copy_(moved)

    # -- when the offload is undone, or the state is saved ------------------------------------------------
    @torch.no_grad()
    def gather_weights(self, params: Sequence[torch.nn.Parameter], dtypes: Sequence[torch.dtype],
                       current: Collection[int] = ()) -> None:
        """Every partitioned parameter's full-precision weight from its owner (but those at `current`, the
        same on every rank already): each owner has put its own back in `params[i].data` (dtype
        `dtypes[i]`); the others receive them there. Every rank walks the same parameters in the same order."""
        for i, owner in sorted(self.owner.items()):
            if owner == EVERY or i in current:
                continue
            p = params[i]
            if owner != self.rank:
                p.data = torch.empty(p.shape, dtype=dtypes[i], device=p.device)
            self._broadcast(p.data, owner)

    @torch.no_grad()
    def gather_masters(self, own: dict[int, torch.Tensor], shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype],
                       skip: Collection[int] = ()) -> dict[int, torch.Tensor]:
        """The full-precision weights of the parameters other ranks step, as host tensors (a model state dict
        under the partitioned state). `own`: this rank's masters by position; `skip`: positions current on every
        rank. Every rank walks the same parameters in the same order."""
        out: dict[int, torch.Tensor] = {}
        for i, owner in sorted(self.owner.items()):
            if owner == EVERY or i in skip:
                continue
            if owner == self.rank:
                self._broadcast(own[i].detach(), owner)
                continue
            out[i] = torch.empty(shapes[i], dtype=dtypes[i])
            self._broadcast(out[i], owner)
        return out

    @torch.no_grad()
    def gather_state(self, states: dict[int, dict[str, Any]], keys: Sequence[torch.Tensor], into: Gathered) -> None:
        """The state of every parameter another rank steps, into `into.state[keys[i]]` (host tensors).

        `states`: this rank's own, by position. Each owner first sends what its entries hold (names,
        shapes, dtypes; plain values such as a step count as they are), then the tensors one by one.
        """
        into.state.clear()
        for owner in range(self.world):
            mine = owner == self.rank
            layout = [{i: {k: _describe(v) for k, v in states[i].items()} for i in self.of(owner) if i in states}
                      if mine else None]
            dist.broadcast_object_list(layout, src=owner, device=self.device if self.device.type == "cuda" else None)
            sent = layout[0]
            assert sent is not None, "broadcast_object_list fills the layout on every rank"
            for i, entry in sent.items():
                got: dict[str, Any] = {}
                for k, (kind, value) in entry.items():
                    if kind == "value":
                        got[k] = value
                        continue
                    shape, dtype = value
                    t = states[i][k].to(self.device) if mine else torch.empty(shape, dtype=dtype, device=self.device)
                    dist.broadcast(t, owner)
                    got[k] = t.cpu()
                if not mine:
                    into.state[keys[i]] = got


def _describe(value: Any) -> tuple[str, Any]:
    if isinstance(value, torch.Tensor):
        return "tensor", (tuple(value.shape), value.dtype)
    return "value", value
