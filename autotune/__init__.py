"""autotune: make PyTorch training jobs fit in GPU memory and run fast.

    plan = autotune.fit(model, batch, global_batch_size=64, memory_budget="24GiB")
    step = plan.apply(model, optimizer)
    loss = step(global_batch)
"""

from .api import fit
from .cache import PlanCache
from .cache.guard import CacheWarning
from .configuration import Rung
from .errors import AutotuneError, DeviceError, InvalidSetting, NoFeasiblePlan, RankDied, is_oom
from .evidence import Trial
from .plan import Plan
from .workload.batch import Shared

__version__ = "0.1.0"

__all__ = [
    "AutotuneError",
    "CacheWarning",
    "DeviceError",
    "InvalidSetting",
    "NoFeasiblePlan",
    "Plan",
    "PlanCache",
    "RankDied",
    "Rung",
    "Shared",
    "Trial",
    "fit",
    "is_oom",
    "__version__",
]
