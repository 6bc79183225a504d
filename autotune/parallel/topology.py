"""How the ranks spread over machines: the node count and ranks per node, read from torchrun's environment, and
what depends on it: the 2-D device mesh of hybrid sharding, a rank named by its node, and the plan every rank
must agree on at the end of `fit`.

torchrun gives every worker `WORLD_SIZE`, `LOCAL_WORLD_SIZE` (the ranks on its node) and `GROUP_RANK` (its
node's index), and numbers the ranks node by node: the ranks of node `n` are `n * ranks_per_node` up to the next
node's first. Without torchrun's variables (a group the user initialised by hand, a test's file rendezvous)
every rank counts as one node: the plan never assumes a slower link it was not told about.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import settings, torch_private
from ..devices.shards import fsdp_units
from ..errors import AutotuneError, InvalidSetting
from .ranks import active, collective_device, rank, world_size

REPLICATE, SHARD = "replicate", "shard"  # the hybrid mesh's dimensions: across nodes, within one


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """The ranks of a job as nodes of equal size (torchrun starts as many workers on every node)."""

    nodes: int = 1
    ranks_per_node: int = 1

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology.{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def where(self, rank: int) -> str:
        """A rank as a person looks for it on a cluster: "rank 5 (node 1, local rank 1)"."""
        return f"rank {rank} (node {self.node_of(rank)}, local rank {rank % self.ranks_per_node})"

    def describe(self) -> str:
        """ "2 nodes x 8 ranks", or "4 ranks" on one node."""
        if self.nodes == 1:
            return f"{self.ranks_per_node} rank{'s' if self.ranks_per_node > 1 else ''}"
        return f"{self.nodes} nodes x {self.ranks_per_node} ranks"


def topology() -> Topology:
    """This job's topology: torchrun's `LOCAL_WORLD_SIZE` ranks on each node, `WORLD_SIZE` in all.

    Raises:
        InvalidSetting: `LOCAL_WORLD_SIZE` is not a whole share of the world size (nodes of unequal size, which
            torchrun does not start) or is not a number.
    """
    world = world_size()
    if world == 1:
        return Topology()
    local = _int_variable("LOCAL_WORLD_SIZE", world)
    if local < 1 or world % local:
        raise InvalidSetting(f"LOCAL_WORLD_SIZE={local} does not divide the world size {world}: autotune needs as "
                             "many ranks on every node; launch every node with the same --nproc-per-node")
    return Topology(nodes=world // local, ranks_per_node=local)


def _int_variable(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidSetting(f"{name}={raw!r} is not a number; torchrun sets it: launch with torchrun, or unset "
                             "it") from None


# -- hybrid sharding's mesh, and the link between nodes -----------------------------------------------------

def hybrid_mesh(nodes: int, device_type: str) -> Any:
    """The 2-D device mesh of hybrid sharding: `nodes` rows of this node's ranks (FSDP2 shards along a row,
    within a node, and all-reduces the shards' gradients down a column, across nodes).

    Raises:
        InvalidSetting: the job runs on another number of nodes than `nodes` (a plan tuned elsewhere).
    """
    from torch.distributed.device_mesh import init_device_mesh

    here = topology()
    if here.nodes != nodes:
        raise InvalidSetting(f"the plan shards within each of {nodes} nodes (plan.sharding='hsdp') and this job runs "
                             f"on {here.describe()}: launch on {nodes} nodes, or tune again on this topology")
    # One mesh per group: every call of init_device_mesh makes new process groups (a collective of its own).
    key = (id(dist.group.WORLD), device_type, here)
    if key not in _meshes:
        _meshes.clear()
        _meshes[key] = init_device_mesh(device_type, (here.nodes, here.ranks_per_node),
                                        mesh_dim_names=(REPLICATE, SHARD))
    return _meshes[key]


_meshes: dict[tuple[int, str, Topology], Any] = {}


def link_delay_seconds() -> float:
    """`AUTOTUNE_TEST_CROSS_NODE_DELAY_MS` in seconds, 0 when unset. For tests only: simulated nodes on one
    machine talk as fast as their ranks do, so a test that needs a slow link between them sets this, and every
    collective that crosses nodes (`cross_node_pause`) waits that long more."""
    raw = settings.read(settings.CROSS_NODE_DELAY_ENV)
    try:
        return max(0.0, float(raw)) / 1000 if raw else 0.0
    except ValueError:
        raise InvalidSetting(f"{settings.CROSS_NODE_DELAY_ENV}={raw!r} is not a number of milliseconds; unset "
                             "it") from None


def cross_node_pause() -> None:
    """Where a collective crosses nodes: wait the test-only link delay (nothing outside tests)."""
    delay = link_delay_seconds()
    if delay:
        time.sleep(delay)


def slow_link(model: torch.nn.Module, *, hybrid: bool, nodes: int) -> None:
    """Under the test-only link delay (`link_delay_seconds`), make each FSDP2 collective of `model` that crosses
    nodes wait it: every all-gather and reduce-scatter of a flat mesh over several nodes, the all-reduce across
    nodes of a hybrid one. Nothing happens outside tests, or on one node."""
    from .fsdp_comms import wrap_comms

    if not link_delay_seconds() or nodes < 2:
        return
    for unit in fsdp_units(model):
        if hybrid:
            if len(torch_private.fsdp_param_groups(torch_private.fsdp_state(unit))) == 1:
                unit.set_all_reduce_hook(lambda _: cross_node_pause())  # (a unit without parameters runs none)
        else:
            wrap_comms(unit, after=cross_node_pause)


def cross_node_seconds(mesh: Any, nbytes: int, repeats: int = 3) -> float:
    """Median seconds of one all-reduce of `nbytes` across nodes (over the mesh's replicate dimension), as hybrid
    sharding runs it for every shard's gradients: timed on this job's own link, not assumed."""
    group = mesh.get_group(REPLICATE)
    device = collective_device()
    buffer = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    times = []
    for _ in range(repeats + 1):  # the first opens the connections
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(buffer, group=group)
        cross_node_pause()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    median = torch.tensor([sorted(times[1:])[len(times[1:]) // 2]], dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)  # the slowest pair of nodes, the same figure on every rank
    return float(median.item())


# -- one plan on every rank ---------------------------------------------------------------------------------

def digest(config: dict[str, Any]) -> str:
    """SHA-256 of a plan's configuration as canonical JSON: equal on two ranks exactly when their plans are."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def agree_on_plan(config: dict[str, Any]) -> None:
    """Check that every rank holds the same plan: the digests of their configurations, all-gathered.

    Every rank decided on figures agreed over all ranks, so the plans agree unless the ranks ran different
    code or settings (another autotune or torch on one node, a different `fit` call, another cache row).

    Raises:
        AutotuneError: naming the ranks (with their nodes) whose plan differs from rank 0's.
    """
    if not active():
        return
    # The longest sequence each rank's own example held: trials agree on the worst, the record may differ.
    config = {name: value for name, value in config.items() if name != "max_length"}
    mine = torch.tensor(list(bytes.fromhex(digest(config))), dtype=torch.int32, device=collective_device())
    gathered = [torch.zeros_like(mine) for _ in range(world_size())]
    dist.all_gather(gathered, mine)
    digests = [bytes(t.tolist()).hex() for t in gathered]
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        where = topology()
        names = ", ".join(f"{where.where(r)} {digests[r][:12]}" for r in differ)
        raise AutotuneError(
            f"the ranks' plans differ: {names} against rank 0's {digests[0][:12]} (this is {where.where(rank())}). "
            "Every rank must run the same autotune, torch and fit arguments, and see the same plan cache "
            "(AUTOTUNE_CACHE): fix the odd ranks' environment, or pass retune=True to tune again on every rank")
