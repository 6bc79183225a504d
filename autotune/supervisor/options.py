"""`RunOptions`: what `autotune run` was asked to do, validated before anything starts."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import InvalidSetting
from ..settings import DEFAULT_MARGIN, DEFAULT_MEASURED_STEPS, FitSettings
from ..sizes import parse_bytes
from ..workload.batching import per_rank_batch
from .flags import preset_maps

DEFAULT_MAX_RESTARTS = 3
DEFAULT_TRIAL_TIMEOUT = 600.0
DEFAULT_GRACE = 10.0


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions:
    """What `autotune run` was asked to do; validates itself (raising `InvalidSetting`, exit 2).

    Large: a record, one field per command-line option; its only behaviour is checking them.
    """

    script: str
    script_args: tuple[str, ...] = ()
    global_batch_size: int | None = None
    budget: str | None = None
    host_budget: str | None = None  # host memory the plan may use (cooperative: the job's fit reads it)
    max_length: int | None = None  # the longest sequence training will see (cooperative: the job's fit reads it)
    cache: str | None = None  # a path, or "off"; default $AUTOTUNE_CACHE, else the user cache
    margin: float | None = None
    max_restarts: int = DEFAULT_MAX_RESTARTS
    trial_steps: int | None = None  # measured optimizer steps per trial, after one warm-up step
    trial_timeout: float = DEFAULT_TRIAL_TIMEOUT
    tune_only: bool = False
    json_output: bool = False  # our stdout carries the plan alone; the job's stdout goes to stderr
    nproc_per_node: int | None = None  # launch through torch.distributed.run with this many ranks
    maps: tuple[str, ...] = ()
    preset: str | None = None  # a named set of maps (flags.PRESETS); --map entries override its entries
    device: str | None = None
    grace_period: float = DEFAULT_GRACE  # seconds between a polite signal and SIGKILL
    verbose: bool = False  # show zero-change trials' own output
    retune: bool = False  # tune again even when the cache holds a plan for this workload
    progress: bool = True  # a line per trial on stderr (live on a terminal); off with -q

    def __post_init__(self) -> None:
        if not os.path.isfile(self.script):
            raise InvalidSetting(f"SCRIPT {self.script!r} is not a file; pass the path of a Python training script")
        if self.max_restarts < 0:
            raise InvalidSetting(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if self.trial_timeout <= 0 or self.grace_period < 0:
            raise InvalidSetting("--trial-timeout must be positive and --grace-period not negative")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise InvalidSetting(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.nproc_per_node is not None and self.global_batch_size is not None:
            try:  # refused before launch: every rank would fail (or, without torch.distributed, train alone)
                per_rank_batch(self.global_batch_size, self.nproc_per_node)
            except InvalidSetting as exc:
                raise InvalidSetting(f"--global-batch-size {self.global_batch_size} with --nproc-per-node "
                                     f"{self.nproc_per_node}: {exc}") from None
        if self.budget is not None:
            parse_bytes(self.budget, "--budget")
        if self.host_budget is not None:
            parse_bytes(self.host_budget, "--host-budget")
        preset_maps(self.preset)  # an unknown preset fails here, listing the known ones
        # The same checks fit applies, so a bad value fails here and not inside the job.
        FitSettings(global_batch_size=self.global_batch_size, margin=DEFAULT_MARGIN if self.margin is None
                    else self.margin, measured_steps=self.trial_steps or DEFAULT_MEASURED_STEPS)

    @property
    def host_budget_bytes(self) -> int | None:
        """`--host-budget` in bytes, or None where it was not given."""
        return parse_bytes(self.host_budget, "--host-budget") if self.host_budget is not None else None

    @property
    def world_size(self) -> int:
        return self.nproc_per_node or 1

    @property
    def zero_change(self) -> bool:
        return bool(self.maps or self.preset)
