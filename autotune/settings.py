"""`FitSettings`: fit's arguments and their `AUTOTUNE_*` environment defaults, validated in one place; and every
other `AUTOTUNE_*` variable autotune reads (`VARIABLES`), read only through `read` and `switch` here.

An argument passed to `fit` wins; otherwise the environment variable (set by `autotune run`, or by hand);
otherwise the default below. Each default is defined once, here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .devices import placement
from .devices.peaks import PEAK_ENV  # its name lives below, where the peak table is
from .errors import InvalidSetting
from .sizes import brief, parse_bytes
from .workload.batching import check_global_batch_size

ENV_PREFIX = "AUTOTUNE_"
DEFAULT_MARGIN = 0.10
DEFAULT_WARMUP_STEPS = 1
DEFAULT_MEASURED_STEPS = 3
DEFAULT_MAX_TRIALS = 24

ENV = {
    "global_batch_size": "AUTOTUNE_GLOBAL_BATCH_SIZE",
    "memory_budget": "AUTOTUNE_MEMORY_BUDGET",
    "host_memory_budget": "AUTOTUNE_HOST_BUDGET",
    "max_length": "AUTOTUNE_MAX_LENGTH",
    "margin": "AUTOTUNE_MARGIN",
    "device": "AUTOTUNE_DEVICE",
    "cache": "AUTOTUNE_CACHE",
    "techniques": "AUTOTUNE_TECHNIQUES",
    "measured_steps": "AUTOTUNE_TRIAL_STEPS",
    "max_micro_batch": "AUTOTUNE_MAX_MICRO_BATCH",
    "retune": "AUTOTUNE_RETUNE",
    "max_tune_seconds": "AUTOTUNE_MAX_TUNE_SECONDS",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class FitSettings:
    global_batch_size: int | None = None
    memory_budget: int | str | None = None
    host_memory_budget: int | str | None = None
    max_length: int | None = None
    margin: float = DEFAULT_MARGIN
    device: str | None = None
    cache: Any = None
    techniques: Any = None
    measured_steps: int = DEFAULT_MEASURED_STEPS
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    max_trials: int = DEFAULT_MAX_TRIALS
    max_micro_batch: int | None = None
    retune: bool = False
    max_tune_seconds: float | None = None  # no new trial starts past it, once a configuration fitted

    def __post_init__(self) -> None:
        if self.global_batch_size is not None:
            check_global_batch_size(self.global_batch_size)
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget)  # NaN, infinite, negative or unreadable: refused before any work
        if self.host_memory_budget is not None:
            parse_bytes(self.host_memory_budget, "host_memory_budget")
        if self.max_length is not None and (isinstance(self.max_length, bool) or not isinstance(self.max_length, int)
                                            or self.max_length < 1):
            raise InvalidSetting(f"max_length must be a positive number of tokens (the longest sequence training "
                                 f"will see), got {brief(self.max_length)}")
        if (isinstance(self.margin, bool) or not isinstance(self.margin, (int, float))
                or not 0 <= self.margin < 0.9):  # NaN fails the range test too
            raise InvalidSetting(f"margin must be a fraction in [0, 0.9), e.g. 0.1 for 10% headroom; "
                                 f"got {brief(self.margin)}")
        for name in ("measured_steps", "max_trials"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidSetting(f"{name} must be a positive integer, got {brief(value)}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise InvalidSetting(f"warmup_steps must be 0 or a positive integer, got {brief(self.warmup_steps)}")
        if self.measured_steps < 2 and self.warmup_steps < 1:
            raise InvalidSetting("a trial needs at least two optimizer steps: "
                                 "warmup_steps >= 1 and measured_steps >= 1")
        bad = isinstance(self.max_micro_batch, bool) or not isinstance(self.max_micro_batch, int)
        if self.max_micro_batch is not None and (bad or self.max_micro_batch < 1):
            raise InvalidSetting(f"max_micro_batch must be a positive integer, got {brief(self.max_micro_batch)}")
        if self.techniques is not None:
            object.__setattr__(self, "techniques", _technique_names(self.techniques))
        bound = self.max_tune_seconds
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound > 0
                                  or bound == float("inf")):
            raise InvalidSetting(f"max_tune_seconds must be a positive number of seconds, e.g. 120; got {brief(bound)}")

    @classmethod
    def resolve(cls, **given: Any) -> FitSettings:
        """Arguments that are None or not given fall back to their `AUTOTUNE_*` variable, then to the default.

        Every variable in `ENV` is read, so one that fit has no argument for (AUTOTUNE_MAX_MICRO_BATCH, set
        by `autotune run` after an OOM) still applies.
        """
        values: dict[str, Any] = {}
        for name in [*given, *(n for n in ENV if n not in given)]:
            value = given.get(name)
            if value is None and name in ENV:
                value = _from_env(name)
            if value is not None:
                values[name] = value
        return cls(**values)


def _technique_names(techniques: Any) -> str | tuple[str, ...]:
    """A comma-separated string as given, else the names as a tuple (a generator is read once, here)."""
    if isinstance(techniques, str):
        return techniques
    if isinstance(techniques, Iterable) and not isinstance(techniques, (bytes, dict)):
        names = tuple(techniques)
        if all(isinstance(t, str) for t in names):
            return names
    raise InvalidSetting(f"techniques must be technique names, e.g. techniques=('bf16', 'checkpointing') or "
                         f"techniques=() for none; got {brief(techniques)}")


def _from_env(name: str) -> Any:
    var = ENV[name]
    raw = os.environ.get(var)
    if raw is None or raw == "":
        return None
    if name == "retune":
        return on_or_off(var, raw, default=False)
    try:
        if name in ("global_batch_size", "measured_steps", "max_micro_batch", "max_length"):
            return int(raw)
        if name in ("margin", "max_tune_seconds"):
            return float(raw)
        if name == "cache" and raw.lower() in ("0", "false", "off", "no"):
            return False
    except ValueError as exc:
        raise InvalidSetting(f"environment variable {var}={raw!r} is not a valid {name}; unset it or fix it") from exc
    return raw


RESULT_FILE_ENV = "AUTOTUNE_RESULT_FILE"
TEAM_DIR_ENV = "AUTOTUNE_TEAM_DIR"
PROGRESS_ENV = "AUTOTUNE_PROGRESS"
OFFLOAD_OVERLAP_ENV = "AUTOTUNE_OFFLOAD_OVERLAP"
OFFLOAD_PARTITION_ENV = "AUTOTUNE_OFFLOAD_PARTITION"
OFFLOAD_STREAM_ENV = "AUTOTUNE_OFFLOAD_STREAM"
COMPILE_REGIONS_ENV = "AUTOTUNE_COMPILE_REGIONS"
COMPILE_STATIC_ENV = "AUTOTUNE_COMPILE_STATIC"
ATTENTION_BUCKETS_ENV = "AUTOTUNE_ATTENTION_BUCKETS"
RESTART_COUNT_ENV = "AUTOTUNE_RESTART_COUNT"
AGENT_STEPS_ENV = "AUTOTUNE_AGENT_STEPS"
AGENT_BUDGET_ENV = "AUTOTUNE_AGENT_BUDGET"
AGENT_DEVICE_ENV = "AUTOTUNE_AGENT_DEVICE"
AGENT_LAUNCHED_ENV = "AUTOTUNE_AGENT_LAUNCHED"
FORK_TRIALS_ENV = "AUTOTUNE_FORK_TRIALS"
TUNE_ONLY_ENV = "AUTOTUNE_TUNE_ONLY"
LOG_LEVEL_ENV = "AUTOTUNE_LOG_LEVEL"
CROSS_NODE_DELAY_ENV = "AUTOTUNE_TEST_CROSS_NODE_DELAY_MS"
CPU_BF16_ENV = "AUTOTUNE_CPU_BF16"

# Every AUTOTUNE_* variable autotune reads, and what it means (the README lists the same).
VARIABLES: dict[str, str] = {
    ENV["global_batch_size"]: "fit's global_batch_size",
    ENV["memory_budget"]: "fit's memory_budget, e.g. 24GiB",
    ENV["host_memory_budget"]: "fit's host_memory_budget, e.g. 96GiB",
    ENV["max_length"]: "fit's max_length: the longest sequence training will see",
    ENV["margin"]: "the share of the budget kept free, 0.10 by default",
    ENV["device"]: "fit's device: cuda, cuda:N or cpu",
    ENV["cache"]: "the plan cache's path, or off",
    ENV["techniques"]: "fit's techniques, comma-separated",
    ENV["measured_steps"]: "measured steps per trial",
    ENV["max_micro_batch"]: "the largest micro-batch the search tries",
    ENV["retune"]: "1: tune again even where the cache has a plan",
    ENV["max_tune_seconds"]: "fit's max_tune_seconds: no new trial starts past it, once a configuration fitted",
    TEAM_DIR_ENV: "a shared folder of plan files the team reads and writes",
    PROGRESS_ENV: "live, lines or off: how trials' progress is shown",
    PEAK_ENV: "the GPU's peak TFLOP/s, where autotune's table does not know it",
    OFFLOAD_OVERLAP_ENV: "0: the host's optimizer step never overlaps the last backward",
    OFFLOAD_PARTITION_ENV: "0: replicated ranks do not partition the offloaded optimizer state",
    OFFLOAD_STREAM_ENV: "0 or 1: step the host share on the GPU streamed, or never (default: where a GPU is)",
    COMPILE_REGIONS_ENV: "blocks or whole: what torch.compile wraps",
    COMPILE_STATIC_ENV: "0: training keeps the trials' dynamic graphs instead of compiling its shape once, static",
    CPU_BF16_ENV: "0 or 1: on the CPU, keep fp32 or search bf16 (default: where the CPU runs bf16 natively)",
    ATTENTION_BUCKETS_ENV: "0 or 1: pad masked attention (causal once lengths vary) to 64 tokens, or never (default: "
                           "under cuDNN's)",
    RESULT_FILE_ENV: "set by `autotune run`: where its job records how it ended",
    RESTART_COUNT_ENV: "set by `autotune run`: how many times the job was restarted",
    AGENT_STEPS_ENV: "set by `autotune run`: a zero-change trial stops after this many optimizer steps",
    AGENT_BUDGET_ENV: "set by `autotune run`: a memory ceiling in bytes for the whole script",
    AGENT_DEVICE_ENV: "set by `autotune run`: cuda or cpu, the kind of ceiling",
    AGENT_LAUNCHED_ENV: "set by `autotune run`: when a zero-change trial was launched (seconds since the epoch)",
    FORK_TRIALS_ENV: "0: zero-change trials start as fresh processes, not forked from one that imported once",
    TUNE_ONLY_ENV: "set by `autotune run --tune-only`: the job exits once fit has its plan",
    LOG_LEVEL_ENV: "set by `autotune run`: the verbosity of autotune's log in the job",
    CROSS_NODE_DELAY_ENV: "tests only: milliseconds every collective between simulated nodes waits (a slow link)",
}
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def read(name: str, default: str = "") -> str:
    """The environment variable `name` (one of `VARIABLES`), stripped; `default` where it is unset or empty."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not one of autotune's variables (settings.VARIABLES)")
    return os.environ.get(name, "").strip() or default


def switch(name: str, default: bool = True) -> bool:
    """An on/off variable: on for 1, true, yes or on; off for 0, false, no or off (any case); `default` where it
    is unset or empty.

    Raises:
        InvalidSetting: any other value, naming the variable and the values it takes.
    """
    return on_or_off(name, read(name), default=default)


def on_or_off(name: str, raw: str, *, default: bool) -> bool:
    """`raw`, the value of the on/off variable `name`, as a bool; `default` where it is empty.

    Raises:
        InvalidSetting: a value that is neither on nor off: a typo must not pick a side silently.
    """
    value = raw.strip().lower()
    if not value:
        return default
    if value in _ON or value in _OFF:
        return value in _ON
    raise InvalidSetting(f"{name}={raw.strip()!r} is neither on nor off: set it to one of {', '.join(_ON)} (on) or "
                         f"{', '.join(_OFF)} (off), or unset it for the default ({'on' if default else 'off'})")


def cpu_bf16(native: bool | None = None) -> bool:
    """Whether the search measures bf16 on the CPU (the simulated device): where the CPU runs it natively
    (`native`, read from the CPU's features when not given), unless $AUTOTUNE_CPU_BF16 says otherwise.
    Elsewhere torch emulates bf16, several times slower than fp32, so by default a CPU plan stays in fp32; 1
    searches bf16 all the same (a CPU run that should choose as a bf16 GPU would, as the test suite does), 0
    keeps fp32 on any CPU.

    Raises:
        InvalidSetting: $AUTOTUNE_CPU_BF16 is neither on nor off.
    """
    return switch(CPU_BF16_ENV, default=placement.cpu_has_native_bf16() if native is None else native)


def result_file() -> str | None:
    """$AUTOTUNE_RESULT_FILE: where a job of `autotune run` records how it ended; None outside `autotune run`."""
    return read(RESULT_FILE_ENV) or None
