"""The CUDA caching allocator's expandable segments: autotune turns them on unless the user configured the allocator.

With fixed segments, a block freed at one size serves the next request only if it is large enough and the
allocator splits it; over changing shapes (padded batches of every length, an uneven last micro-batch, the
offload streams' buffers) the cache keeps segments that fit nothing, and under a memory cap the allocator
frees and re-allocates them with synchronizing cudaFree calls. Reserved memory then climbs past what the plan
measured allocated: GPT-2 large at 24 GiB reserved 3.3 GiB more than its allocated peak over 100 fixed-shape
steps. Expandable segments map memory into one growing segment per stream, so what is freed serves any size.

`autotune run` puts the setting in the environment of every job it starts (trials and the real run), before
CUDA starts; `fit` sets it in its own process before its first trial, so the trials measure under it and
training keeps it. A user's `PYTORCH_CUDA_ALLOC_CONF` (or `PYTORCH_ALLOC_CONF`) is left as it is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from .. import torch_private

log = logging.getLogger(__name__)

CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the CUDA name, and the newer generic one
SETTING = "expandable_segments:True"


def user_configured(environ: Mapping[str, str]) -> str | None:
    """The allocator configuration the user set in `environ` (as `NAME=value`), or None."""
    for name in CONF_ENVS:
        if environ.get(name):
            return f"{name}={environ[name]}"
    return None


def job_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What a job's environment adds: expandable segments, unless `environ` configures the allocator."""
    return {} if user_configured(environ) else {CONF_ENVS[0]: SETTING}


class _Chosen:
    """What `expand_in_process` did in this process, for the plan's reason."""

    note: str | None = None


_CHOSEN = _Chosen()


def expand_in_process(environ: Mapping[str, str] = os.environ) -> str:
    """Turn expandable segments on in this process (CUDA), unless the user configured the allocator; the note
    for the plan's reason, also kept for `note()`. Memory the allocator holds already keeps its segments; new
    segments expand."""
    given = user_configured(environ)
    if given is not None:
        _CHOSEN.note = f"allocator as {given} sets it"
        return _CHOSEN.note
    # torch's own setter: the accelerator-wide one where torch has it (the CUDA one is deprecated there)
    setter = torch_private.allocator_setter()
    try:
        setter(SETTING)
    except (AttributeError, RuntimeError) as exc:  # an allocator without the setting (cudaMallocAsync, older torch)
        log.info("autotune: the CUDA allocator keeps its settings (%s)", exc)
        _CHOSEN.note = f"allocator unchanged: {exc}"
        return _CHOSEN.note
    _CHOSEN.note = ("allocator: expandable segments, so memory freed at one shape serves the next (set "
                    "PYTORCH_CUDA_ALLOC_CONF to choose otherwise)")
    return _CHOSEN.note


def note() -> list[str]:
    """The plan's word on the allocator: what `expand_in_process` did in this process, if it ran."""
    return [_CHOSEN.note] if _CHOSEN.note else []
