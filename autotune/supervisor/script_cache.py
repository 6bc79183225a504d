"""The plan cache for scripts tuned in zero-change mode: their key, and what a real run leaves behind.

A script has no model object for the supervisor to fingerprint, so its key's `model` part is the
script itself: its path, a digest of its source and of its arguments (the mapped flags left out, since
the plan sets those), and the flag map. Editing the script or changing an argument gives another key:
where in doubt the key errs toward a miss (one more tune), as `cache/key.py` does. The other parts
(global batch, world size, device, budget, margin, techniques, runtime versions) are the ones `fit` uses.

What a real run leaves: an OOM is a failure against the plan (`mark_unsafe`, as in cooperative mode);
a finished run's measured rate is stored on the plan (`measured_samples_per_second`). The next tune of
the same key reuses a plan whose claim its run confirmed, and re-tunes one whose claim the run
contradicted, scoring that configuration at the rate it really trained at (`claims.py`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from typing import Any

from ..cache.key import canonical_json, host_part, runtime_versions
from ..plan import PLAN_FORMAT_VERSION, Plan
from ..sizes import shorten
from . import claims
from .flags import FlagMap

log = logging.getLogger(__name__)

_OFF = ("0", "false", "off", "no")


def script_parts(*, script: str, script_args: Sequence[str], flags: FlagMap, global_batch_size: int,
                 world_size: int, device_kind: str, device_name: str, total_bytes: int, budget_bytes: int,
                 margin: float, techniques: frozenset[str], max_micro_batch: int | None = None,
                 host_budget_bytes: int | None = None) -> dict[str, Any]:
    """The cache key's parts for a script run in zero-change mode (the shape `cache.key.check_parts` accepts)."""
    with open(script, "rb") as f:
        source = hashlib.sha256(f.read()).hexdigest()
    digest = hashlib.sha256(canonical_json({"source": source, "args": flags.unmapped(script_args),
                                            "flags": flags.describe()})
                            .encode()).hexdigest()
    return {
        "format": PLAN_FORMAT_VERSION,
        "model": {"class": f"script:{os.path.abspath(script)}", "parameters": 0, "trainable": 0, "digest": digest},
        "batch": [],  # the script batches its own data: its arguments (in the digest) say how
        "global_batch_size": int(global_batch_size),
        "world_size": int(world_size),
        "device": {"kind": device_kind, "name": device_name, "total_bytes": int(total_bytes)},
        "budget_bytes": int(budget_bytes),
        "margin": float(margin),
        "techniques": sorted(techniques),
        "max_micro_batch": max_micro_batch,
        "optimizer": {"class": "the script's own", "groups": []},
        "loss": "the script's own",
        "runtime": runtime_versions(device_kind),
        "host": host_part(techniques, host_budget_bytes),
    }


def open_store(setting: str | None) -> Any:
    """The plan cache `--cache` (else $AUTOTUNE_CACHE, else the user cache) names; None when it is off.

    Never raises: the cache never fails a run.
    """
    from ..settings import ENV, read

    setting = setting if setting is not None else (read(ENV["cache"]) or None)
    if setting is not None and setting.lower() in _OFF:
        return None
    try:
        from ..cache import store as plan_cache

        return plan_cache.open_cache(setting)
    except Exception as exc:  # noqa: BLE001 - the cache never fails a run
        log.warning("plan cache unavailable (%s); tuning without it", exc)
        return None


class RunCache:
    """The plan cache of one `autotune run`: opened on first use, once, and closed when the run ends.

    One connection for the whole run, closed at its end: a connection per record, left for the garbage
    collector, would pile up open files while the jobs' own connections come and go.
    """

    def __init__(self, setting: str | None) -> None:
        self.setting = setting
        self._store: Any = None
        self._opened = False

    def __enter__(self) -> RunCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def store(self) -> Any:
        """The open `PlanCache`, or None when the cache is off or unavailable (said once, by `open_store`)."""
        if not self._opened:
            self._store, self._opened = open_store(self.setting), True
        return self._store

    def close(self) -> None:
        """Close the connection; a later `store()` opens none (the run is over)."""
        if self._store is not None:
            self._store.close()
        self._store, self._opened = None, True


class ScriptCache:
    """One zero-change workload's entry in the plan cache; every method carries on quietly without a cache."""

    def __init__(self, store: Any, parts: dict[str, Any]) -> None:
        from ..cache.key import plan_key

        self.store = store
        self.parts = parts
        self.key = plan_key(parts)

    def plan(self) -> Plan | None:
        """The cached plan (never one an OOM was seen at), with this key."""
        return self.store.get(self.key) if self.store is not None else None

    def max_safe_micro_batch(self) -> int | None:
        return self.store.max_safe_micro_batch(self.key) if self.store is not None else None

    def save(self, plan: Plan) -> Plan:
        """Store a freshly tuned plan; returns it with its key (none with the cache off: `Plan.key` is "" for a
        plan that was never cached)."""
        if self.store is None:
            return plan
        plan = plan.with_provenance(key=self.key)
        self.store.put(plan, self.parts)
        return plan

    def record_run(self, plan: Plan) -> None:
        """Store the plan with what its real run measured, in place of the one without."""
        if self.store is not None:
            self.store.replace(self.key, plan)

    def record_oom(self, plan: Plan, note: str, attempt: int) -> None:
        if self.store is not None:
            note = f"OOM in the real run (autotune run, attempt {attempt + 1}): {note}"
            self.store.mark_unsafe(self.key, micro_batch_size=plan.micro_batch_size, note=shorten(note, 500))

    def first_plan(self, tuner: Any, *, retune: bool = False) -> Plan:
        """The cached plan when its last run confirmed its claim (or none ran yet); else a tune of `tuner` (a
        `ScriptTuner`), which scores a cached plan's configuration at the rate its run really trained at.
        With `retune` (`autotune run --retune`) the cached plan is passed over."""
        cached = None if retune else self.plan()
        if cached is not None and not claims.plan_disagrees(cached):
            log.debug("plan from the cache (%s)", self.key[:12])
            return cached.with_provenance(source="cache")
        if cached is not None:
            measured = cached.measured_samples_per_second or 0.0
            log.warning("the cached plan (%s at micro-batch %d) claimed %.1f samples/s, but its real run trained "
                        "at %.1f: re-tuning, with that configuration scored at the measured rate",
                        cached.rung.name, cached.micro_batch_size, cached.samples_per_second, measured)
            tuner.trials.known[(cached.rung, cached.micro_batch_size)] = measured
        return self.save(tuner.tune(max_micro=self.max_safe_micro_batch()))
