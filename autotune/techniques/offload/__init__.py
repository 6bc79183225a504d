"""Optimizer offload and the offload rung's tensors, behind one interface (`interface.py`).

`interface` (what training and the trials call, and `build_engine`, which picks the engine) · `engine`
(`HostOptimizer`: the base both engines share, the step they have in common) · `host_engine` (the host share
stepped by a CPU optimizer) · `streamed_engine` (the host share stepped by the GPU, its state streamed) ·
`shares` (the parameters' host and device shares: masters, optimizers, partition) · `share_state` (their
weights and state as the user's model and optimizer read them) · `host_copies` (the host-stepped engine's
gradients to the host and weights back) · `streamed` (the device stepper the streamed engine runs) ·
`flat_layout` (one buffer viewed as many tensors, cut into segments) · `pipeline` (the CPU step during the
last backward) · `partition` (the shares partitioned over replicated ranks) · `tensors` (host copies, dtypes,
which parameters go to the host) · `pinned` (large pinned buffers at their exact size) · `host_buffers` (those
buffers kept from one of a tune's trials to the next) · `local` (a rank's part of an FSDP2 shard) ·
`activations` (saved-activation offload: what autograd saves inside blocks, to the host and back behind
compute).
"""

from .engine import HostOptimizer
from .host_engine import HostSteppedEngine
from .interface import NO_OFFLOAD, OptimizerOffload, build_engine, offload_of
from .shares import Shares
from .streamed_engine import StreamedEngine
from .tensors import (
                      NORM_LAYERS,
                      device_dtype,
                      host_share,
                      local_part,
                      master_dtype,
                      norm_parameters,
                      overlap_default,
                      to_device,
                      to_host,
)

__all__ = ["NORM_LAYERS", "NO_OFFLOAD", "HostOptimizer", "HostSteppedEngine", "OptimizerOffload", "Shares",
           "StreamedEngine", "build_engine", "device_dtype", "host_share", "local_part", "master_dtype",
           "norm_parameters", "offload_of", "overlap_default", "to_device", "to_host"]
