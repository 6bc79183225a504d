"""bench_peers.py's JSON lines read back: the records by workload and method, for the table
(`render.py`) and the plot (`plot.py`), which both import it."""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import config_key, config_rung  # adds the repository root to sys.path

METHODS = ("autotune-cold", "autotune-warm", "accelerate", "lightning-power", "lightning-binsearch", "grid")
AUTOTUNE = ("autotune-cold", "autotune-warm")
LABELS = {"autotune-cold": "autotune, cold cache", "autotune-warm": "autotune, warm cache",
          "accelerate": "Accelerate `find_executable_batch_size`",
          "lightning-power": "Lightning `scale_batch_size` power",
          "lightning-binsearch": "Lightning `scale_batch_size` binsearch", "grid": "exhaustive grid (reference)"}
SHORT = {"autotune-cold": "autotune (cold)", "autotune-warm": "autotune (warm)", "accelerate": "Accelerate",
         "lightning-power": "Lightning power", "lightning-binsearch": "Lightning binsearch", "grid": "the grid"}


# -- reading ------------------------------------------------------------------------------------------
def load(paths: list[str]) -> list[dict[str, Any]]:
    """Every record of every file, each tagged with `_at`: "file:line" (the file's name as given)."""
    records = []
    for path in paths:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    records.append({**json.loads(line), "_at": f"{os.path.basename(path)}:{n}"})
    return records


class Workload:
    """One workload's records on one device: the latest tune record per method, the best verification per
    configuration, and what was skipped or broke."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records
        last = next((r for r in reversed(records) if r.get("device")), records[-1])
        self.name, self.spec, self.smoke, self.device = last["workload"], last["spec"], last["smoke"], last["device"]
        self.unit, self.per_sample = self.spec["unit"], self.spec["per_sample"]
        self.tune: dict[str, dict[str, Any]] = {}
        self.problems: dict[str, dict[str, Any]] = {}
        self.verified: dict[tuple[str, str, str, int], dict[str, Any]] = {}
        self.verify_errors: dict[tuple[str, str, str, int], dict[str, Any]] = {}
        for r in records:  # later lines win: a rerun replaces an earlier run of the same method
            method = r.get("method")
            if r["kind"] in ("error", "skip") and r.get("stage") == "verify" and r.get("config"):
                self.verify_errors[config_key(r["config"])] = r
            elif r["kind"] == "tune":
                self.tune[method] = r
                self.problems.pop(method, None)
            elif r["kind"] in ("error", "skip") and method:
                self.problems[method] = r
            elif r["kind"] == "verify":
                key = config_key(r["config"])
                if _steps_done(r) >= _steps_done(self.verified.get(key)):
                    self.verified[key] = r
        self.other_problems = [r for r in records if r["kind"] in ("error", "skip") and not r.get("method")
                               and not (r.get("stage") == "verify" and r.get("config"))]

    # -- figures ------------------------------------------------------------------------------------
    def verification(self, method: str) -> dict[str, Any] | None:
        config = (self.tune.get(method) or {}).get("config")
        return self.verified.get(config_key(config)) if config else None

    def train_rate(self, method: str) -> float | None:
        """Units/s of whole global steps in the verifying run, when it ran at least one step."""
        v = self.verification(method)
        train = (v or {}).get("train") or {}
        if train.get("oom"):
            return None  # a configuration that cannot train has no throughput to compare
        return train["samples_per_second"] * self.per_sample if train.get("samples_per_second") else None

    def trial_rate(self, method: str, outcomes: tuple[str, ...] = ("ok",)) -> float | None:
        """Units/s estimated by autotune's TrialRunner (the grid's measure) in the verifying process, when
        the trial's outcome is one of `outcomes`; unverified, the tuning process's own estimate."""
        if self.verification(method) is None:  # unverified: the method's own estimate (autotune's, the grid's)
            est = (self.tune.get(method) or {}).get("estimated_samples_per_second")
            return est * self.per_sample if est else None
        trial = (self.verification(method) or {}).get("trial") or {}
        return trial["samples_per_second"] * self.per_sample if trial.get("outcome") in outcomes else None

    def trial_outcome(self, method: str) -> str:
        return ((self.verification(method) or {}).get("trial") or {}).get("outcome", "")

    def ratio(self, method: str) -> tuple[float | None, str]:
        """(rate / the grid best's rate, "" or "est."): whole-step rates when both ran, else trial estimates."""
        if "grid" not in self.tune or not self.tune["grid"].get("config"):
            return None, ""
        mine, best = self.train_rate(method), self.train_rate("grid")
        if mine and best:
            return mine / best, ""
        mine, best = self.trial_rate(method), self.trial_rate("grid")
        if mine and best:
            return mine / best, "est."
        return None, ""

    def steps_ok(self, method: str) -> bool | None:
        train = (self.verification(method) or {}).get("train")
        if not train:
            return None
        return not train["oom"]


def _steps_done(record: dict[str, Any] | None) -> int:
    if record is None:
        return -1
    return ((record.get("train") or {}).get("steps_done")) or 0


def workloads(records: list[dict[str, Any]]) -> list[Workload]:
    by: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    named = {(r.get("smoke", False), r["workload"]): r["device"] for r in records if r.get("device")}
    for r in records:  # the driver's own records (skips, kills) name no device: they join their workload's
        device = r.get("device") or named.get((r.get("smoke", False), r["workload"]), "")
        by[(r.get("smoke", False), device, r["workload"])].append(r)
    return [Workload(rs) for _, rs in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1]))]


def rung_name(r: dict[str, Any]) -> str:
    """A rung's label from its recorded dict, as `Rung.name` writes it."""
    return config_rung({"rung": r}).name
