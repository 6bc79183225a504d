"""torch.distributed facts and the collectives autotune needs, below the techniques, training and the search.

`ranks` (which rank, small sums and minima) · `agreement` (one trial on every rank) · `oom` (an OOM on one
rank: every rank leaves at the same collective) · `reduce` (gradients over ranks, grouped collectives) ·
`topology` (nodes and ranks per node, hybrid sharding's mesh, one plan on every rank) · `fsdp_comms` (a call
of ours before or after each of FSDP2's collectives).
"""

from .agreement import agree_trial, merged_trial, trial_figures
from .oom import ANOTHER_RANK_OOM, agree_oom, armed, check_in, guard_collectives, leaving_together, param_groups
from .ranks import active, collective_device, is_writer, rank, smallest, sum_over_ranks, total_and_range, world_size
from .reduce import BUCKET_BYTES, ONE_BUCKET, OverlappedReduce, all_reduce_together, broadcast_together, finish_sharded
from .topology import Topology, agree_on_plan, topology

__all__ = ["ANOTHER_RANK_OOM", "BUCKET_BYTES", "ONE_BUCKET", "OverlappedReduce", "Topology", "active", "agree_oom",
           "agree_on_plan", "agree_trial",
           "all_reduce_together", "armed", "broadcast_together", "check_in", "collective_device", "finish_sharded",
           "guard_collectives", "is_writer", "leaving_together", "merged_trial", "param_groups", "rank", "smallest",
           "sum_over_ranks", "topology", "total_and_range", "trial_figures", "world_size"]
