"""torch.distributed facts and the collectives autotune needs, below the techniques, training and the search.

`ranks` (which rank, small sums and minima) · `agreement` (one trial on every rank) · `oom` (an OOM on one
rank: every rank leaves at the same collective) · `reduce` (gradients over ranks, grouped collectives).
"""

from .agreement import agree_trial, merged_trial, trial_figures
from .oom import ANOTHER_RANK_OOM, agree_oom, armed, check_in, guard_collectives, param_groups
from .ranks import active, collective_device, is_writer, rank, smallest, sum_over_ranks, total_and_range, world_size
from .reduce import BUCKET_BYTES, ONE_BUCKET, OverlappedReduce, all_reduce_together, broadcast_together, finish_sharded

__all__ = ["ANOTHER_RANK_OOM", "BUCKET_BYTES", "ONE_BUCKET", "OverlappedReduce", "active", "agree_oom", "agree_trial",
           "all_reduce_together", "armed", "broadcast_together", "check_in", "collective_device", "finish_sharded",
           "guard_collectives", "is_writer", "merged_trial", "param_groups", "rank", "smallest", "sum_over_ranks",
           "total_and_range", "trial_figures", "world_size"]
