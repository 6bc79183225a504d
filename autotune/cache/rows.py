"""Cache rows: a plan row or a "nothing fits" row, as export, import and a team directory exchange them.

A plan row holds a plan, the key parts it was tuned for, and the OOMs seen against it in real training ("kind"
absent or "plan"). A "nothing fits" row holds a search that found no configuration under its budget: the key
parts, the search's message and its trials, so a teammate's `fit` refuses at once instead of searching again.
Every row read from elsewhere is validated before it is used (`parse_row`): known fields only, types and
ranges, a plan consistent with its parts, the key recomputed from the parts, JSON at most `MAX_DEPTH` deep;
JSON is parsed, never executed, nothing unpickled. A row of another plan format is rejected, naming it.
A row is a claim, not a measurement made here: it is held to what its key allows (`check_plan_matches`) and
to numbers a measurement could give (`check_plan_sane`); its text is escaped (`printable`) and its times are
clamped to now as it is read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import unicodedata
from dataclasses import dataclass
from typing import Any

from ..evidence import Trial
from ..plan import Plan
from .key import check_parts, plan_key

EXPORT_SCHEMA = 1
ROW_FIELDS = ("schema", "key", "parts", "plan", "failures", "updated")  # a plan row; "kind" optional
PLAN_KIND, NOTHING_FITS_KIND = "plan", "nothing_fits"  # the values of a row's "kind"
NOTHING_FITS_FIELDS = ("schema", "kind", "key", "parts", "message", "trials", "time")
MAX_MESSAGE_CHARS = 16_384  # a NoFeasiblePlan message lists every trial in ~40 characters; 400 trials fit
FAILURE_FIELDS = ("micro_batch_size", "shapes", "note", "time")
MAX_LINE_BYTES = 4 * 2**20  # a plan with a few dozen trials is a few KiB; a larger line is not ours
MAX_LINE_CHARS = MAX_LINE_BYTES  # the same bound for a line already in memory
MAX_DEPTH = 32  # a row nests about 6 deep (row > plan > trials > [i] > rung); JSON deeper than this is not ours
MAX_MICRO_BATCHES = 2**20  # per rank per optimizer step: a plan holds its split, one entry per micro-batch
VERIFIED = "verified"  # the origin of an imported plan once one trial here measured it (its figures are ours)
MEASURED_HERE = ("tuned", "replaced", VERIFIED)  # origins of plans measured on this machine (a search, a recovery)


@dataclass(frozen=True, kw_only=True, slots=True)
class Failure:
    """An out-of-memory error seen in real training against a cached plan."""

    micro_batch_size: int  # the micro-batch that ran out of memory
    shapes: dict[str, Any] | None = None  # the failing batch's shapes, e.g. {"input_ids": [8, 4096]}
    note: str = ""
    time: float = 0.0  # unix seconds

    def __post_init__(self) -> None:
        if type(self.micro_batch_size) is not int or self.micro_batch_size < 1:  # (a bool is not a batch size)
            raise ValueError(f"failure micro_batch_size must be a positive integer, got {self.micro_batch_size!r}")
        if self.shapes is not None and not isinstance(self.shapes, dict):
            raise ValueError(f"failure shapes must be an object or null, got {type(self.shapes).__name__}")
        if not isinstance(self.note, str):
            raise ValueError(f"failure note must be a string, got {type(self.note).__name__}")
        _check_time("failure time", self.time)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Failure:
        """Rebuild a failure; unknown fields and bad values raise `ValueError`."""
        if not isinstance(d, dict):
            raise ValueError(f"a failure must be an object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(FAILURE_FIELDS))
        if unknown:
            raise ValueError(f"unknown failure field(s): {', '.join(unknown)}")
        if "micro_batch_size" not in d:
            raise ValueError("a failure needs micro_batch_size")
        failure = cls(**d)
        return dataclasses.replace(failure, note=printable(failure.note), time=not_after_now(failure.time))


@dataclass(frozen=True, kw_only=True, slots=True)
class NothingFits:
    """A search that found no configuration under its budget: its key, the key's parts, why, and its trials."""

    key: str
    parts: dict[str, Any]
    message: str  # the NoFeasiblePlan message: what was tried, the smallest peak against the budget
    trials: tuple[Trial, ...] = ()
    time: float = 0.0  # unix seconds the search ended
    origin: str = ""  # where this copy came from: "search" (here), "import:<file>" or "team:<dir>"; not exported

    def to_dict(self) -> dict[str, Any]:
        """As `autotune cache list --json` prints it: beside the plans, with status "nothing fits"."""
        return {"key": self.key, "status": "nothing fits", "origin": self.origin, "updated": self.time,
                "parts": self.parts, "plan": None, "message": self.message,
                "trials": [t.to_dict() for t in self.trials]}

    def to_json(self) -> str:
        """One line of JSON (no newline), tagged with the export schema version and its kind."""
        return json.dumps({"schema": EXPORT_SCHEMA, "kind": NOTHING_FITS_KIND, "key": self.key, "parts": self.parts,
                           "message": self.message, "trials": [t.to_dict() for t in self.trials],
                           "time": self.time}, sort_keys=True, allow_nan=False)

    @classmethod
    def from_dict(cls, d: Any) -> NothingFits:
        """Validate a decoded "nothing fits" row, as strictly as a plan row (`PlanRow.from_dict`).

        Raises:
            ValueError: the reason the row is rejected (first problem found).
        """
        _check_fields(d, NOTHING_FITS_FIELDS, NOTHING_FITS_FIELDS, NOTHING_FITS_KIND)
        _check_key(d)
        message = d["message"]
        if not isinstance(message, str) or not message.strip():
            raise ValueError("message must be a non-empty string (the search's NoFeasiblePlan message)")
        if len(message) > MAX_MESSAGE_CHARS:
            raise ValueError(f"message is {len(message):,} characters, over the {MAX_MESSAGE_CHARS:,} a "
                             "'nothing fits' row may have")
        if not isinstance(d["trials"], list):
            raise ValueError("trials must be a list")
        trials = tuple(_trial_from(i, t) for i, t in enumerate(d["trials"]))
        _check_time("time", d["time"])
        return cls(key=d["key"], parts=d["parts"], message=printable(message), trials=trials,
                   time=not_after_now(float(d["time"])))


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRow:
    """One exported plan: its key, the key's parts, the plan, and the failures seen against it."""

    key: str
    parts: dict[str, Any]
    plan: Plan
    failures: tuple[Failure, ...] = ()
    updated: float = 0.0  # unix seconds when the plan was tuned or last replaced

    def to_json(self) -> str:
        """One line of JSON (no newline), tagged with the export schema version."""
        return json.dumps({"schema": EXPORT_SCHEMA, "key": self.key, "parts": self.parts,
                           "plan": self.plan.to_dict(), "failures": [f.to_dict() for f in self.failures],
                           "updated": self.updated}, sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, line: str) -> PlanRow:
        """Parse and validate one exported plan line.

        Raises:
            ValueError: the reason the row is rejected (first problem found), also when it is not a plan row.
        """
        row = parse_row(line)
        if not isinstance(row, PlanRow):
            raise ValueError("a 'nothing fits' row, not a plan row")
        return row

    @classmethod
    def from_dict(cls, d: Any) -> PlanRow:
        """Validate a decoded plan row; see `from_json`."""
        _check_fields(d, ROW_FIELDS + ("kind",), ROW_FIELDS, PLAN_KIND)
        _check_key(d)
        _check_split(d["plan"])
        plan = sanitized(_plan_from(d["plan"]))
        check_plan_matches(plan, d["key"], d["parts"])
        check_plan_sane(plan, d["parts"])
        if not isinstance(d["failures"], list):
            raise ValueError("failures must be a list")
        failures = tuple(Failure.from_dict(f) for f in d["failures"])
        _check_time("updated", d["updated"])
        return cls(key=d["key"], parts=d["parts"], plan=plan, failures=failures,
                   updated=not_after_now(float(d["updated"])))


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheEntry:
    """A cached plan as `PlanCache.entries` and the CLI see it."""

    key: str
    parts: dict[str, Any]
    plan: Plan | None  # None when the stored plan no longer validates: stale, or damaged
    failures: tuple[Failure, ...] = ()
    created: float = 0.0  # unix seconds the key first entered this cache
    updated: float = 0.0  # unix seconds the plan was tuned or last replaced
    origin: str = ""  # "tuned", "replaced", "verified", "import:<file>" or "team:<dir>"
    stale: bool = False  # the stored plan is of another plan format: `fit` tunes this key again

    @property
    def smallest_failure(self) -> int | None:
        return min((f.micro_batch_size for f in self.failures), default=None)

    @property
    def status(self) -> str:
        """ "safe", "unsafe" (an OOM was seen at or below its micro-batch), "stale" (another plan format) or
        "invalid" (a stored plan that does not validate)."""
        if self.plan is None:
            return "stale" if self.stale else "invalid"
        failing = self.smallest_failure
        return "unsafe" if failing is not None and self.plan.micro_batch_size >= failing else "safe"

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "status": self.status, "origin": self.origin, "created": self.created,
                "updated": self.updated, "parts": self.parts, "plan": self.plan.to_dict() if self.plan else None,
                "failures": [f.to_dict() for f in self.failures]}

    def to_row(self) -> PlanRow | None:
        """This entry as an export row, if it passes the validation an import applies."""
        if self.plan is None:
            return None
        row = PlanRow(key=self.key, parts=self.parts, plan=self.plan, failures=self.failures, updated=self.updated)
        return PlanRow.from_json(row.to_json())

    @classmethod
    def from_row(cls, row: PlanRow, origin: str) -> CacheEntry:
        return cls(key=row.key, parts=row.parts, plan=row.plan, failures=row.failures, created=row.updated,
                   updated=row.updated, origin=origin)


def check_plan_matches(plan: Plan, key: str, parts: dict[str, Any]) -> None:
    """A plan must answer the question its parts ask: same batch sizes, budget, margin, device, techniques.

    Raises:
        ValueError: naming the first disagreement.
    """
    pairs = [("key", plan.key, key), ("global_batch_size", plan.global_batch_size, parts["global_batch_size"]),
             ("world_size", plan.world_size, parts["world_size"]), ("nodes", plan.config.nodes, parts.get("nodes", 1)),
             ("memory_budget_bytes", plan.memory_budget_bytes, parts["budget_bytes"]),
             ("margin", plan.margin, parts["margin"]), ("device", plan.device, parts["device"]["kind"])]
    for name, have, want in pairs:
        if have != want:
            raise ValueError(f"plan.{name} is {have!r} but the key parts say {want!r}")
    allowed = set(parts["techniques"])
    used = {f"{plan.precision} precision": plan.precision != "fp32" and "bf16" not in allowed,
            "checkpointing": plan.checkpointing != "none" and "checkpointing" not in allowed
            or plan.recompute_policy != "whole_block" and "selective_recompute" not in allowed,
            "offload": plan.offload != "none" and {"offload", "saved_activations"}.isdisjoint(allowed),
            "compile": plan.compile and "compile" not in allowed,
            "8-bit optimizer state": plan.optimizer_8bit and "optimizer_8bit" not in allowed,
            "fp8": plan.fp8 and "fp8" not in allowed}
    for what, refused in used.items():
        if refused:
            raise ValueError(f"plan uses {what}, which its key parts do not allow (techniques {sorted(allowed)})")
    wider = sorted(set(plan.techniques or ()) - allowed)
    if wider:
        raise ValueError(f"plan.techniques name {', '.join(wider)}, which its key parts do not allow (techniques "
                         f"{sorted(allowed)})")
    cap = parts["max_micro_batch"]
    if cap is not None and plan.micro_batch_size > cap:
        raise ValueError(f"plan.micro_batch_size {plan.micro_batch_size} is over the key's max_micro_batch {cap}")


def check_plan_sane(plan: Plan, parts: dict[str, Any]) -> None:
    """A plan's numbers must be ones a measurement of its key could give: a micro-batch within the per-rank
    batch, and a peak no smaller than its model's parameters at one byte each (a rank's shard under FSDP2).

    Raises:
        ValueError: naming the first number that cannot be.
    """
    per_rank = plan.global_batch_size // plan.world_size
    if plan.micro_batch_size > per_rank:
        raise ValueError(f"plan.micro_batch_size {plan.micro_batch_size} is over the per-rank batch {per_rank} "
                         f"(global batch {plan.global_batch_size} over {plan.world_size} rank(s))")
    parameters = parts["model"]["parameters"]
    held = parameters // plan.config.shard_ranks  # a rank's shard under FSDP2 or hybrid sharding
    floor = max(1, held)  # every parameter sits on the device during a step, in one byte or more
    if plan.peak_memory_bytes < floor:
        raise ValueError(f"plan.peak_memory_bytes {plan.peak_memory_bytes:,} is under {floor:,}, the least "
                         f"its model's {parameters:,} parameters take on a device, so it was not measured")


def sanitized(plan: Plan) -> Plan:
    """`plan` with every text it carries (reason, device name, block paths, trial notes) as printable strings:
    a plan from a file or a teammate may hold terminal escape sequences, and these texts are printed."""
    plan = dataclasses.replace(plan, evidence=plan.evidence.with_texts(lambda text: printable(str(text))))
    return (plan.with_config(block_paths=tuple(printable(p) for p in plan.block_paths))
            .with_provenance(device_name=printable(str(plan.device_name))))


def not_after_now(seconds: float) -> float:
    """A time read from a row, no later than now: a row dated in the future would outrank every later plan."""
    return min(seconds, time.time())


def parse_row(line: str) -> PlanRow | NothingFits:
    """Parse and validate one exported line, a plan row or a "nothing fits" row by its "kind".

    Raises:
        ValueError: the reason the row is rejected (first problem found).
    """
    if len(line) > MAX_LINE_CHARS:
        raise ValueError(f"line is {len(line):,} characters, over the {MAX_LINE_CHARS:,} a row may have")
    try:
        d = json.loads(line, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:  # the C parser gives up near Python's recursion limit (about 1000 levels)
        raise ValueError(f"JSON nested deeper than the {MAX_DEPTH} levels a row may have") from None
    if _depth(d) > MAX_DEPTH:
        raise ValueError(f"JSON nested deeper than the {MAX_DEPTH} levels a row may have")
    kind = d.get("kind", PLAN_KIND) if isinstance(d, dict) else PLAN_KIND
    if kind == NOTHING_FITS_KIND:
        return NothingFits.from_dict(d)
    if kind != PLAN_KIND:
        raise ValueError(f"kind {str(kind)[:40]!r} is neither {PLAN_KIND!r} nor {NOTHING_FITS_KIND!r}; export it "
                         "again with this autotune, or upgrade autotune")
    return PlanRow.from_dict(d)


def _check_fields(d: Any, allowed: tuple[str, ...], required: tuple[str, ...], kind: str) -> None:
    """A row is an object of `kind` (a plan row may leave "kind" out), with known fields only, every required
    one, and this export schema."""
    if not isinstance(d, dict):
        raise ValueError(f"a row must be an object, got {type(d).__name__}")
    unknown, missing = sorted(set(d) - set(allowed)), sorted(set(required) - set(d))
    if unknown or missing:
        raise ValueError(f"unknown field(s): {', '.join(unknown)}" if unknown
                         else f"missing field(s): {', '.join(missing)}")
    if d["schema"] != EXPORT_SCHEMA:
        raise ValueError(f"export schema {d['schema']!r} is not {EXPORT_SCHEMA}; export it again with this "
                         "autotune, or upgrade autotune")
    if d.get("kind", PLAN_KIND) != kind:
        raise ValueError(f"kind {str(d['kind'])[:40]!r} is not {kind!r}")


def _check_key(d: dict[str, Any]) -> None:
    """The row's parts are well formed and hash to its key: an edited or damaged row is never trusted."""
    check_parts(d["parts"])
    expected = plan_key(d["parts"])
    if d["key"] != expected:
        raise ValueError(f"key {str(d['key'])[:16]!r}... does not match its parts (they hash to "
                         f"{expected[:16]}...): the row was edited or damaged")


def printable(text: str) -> str:
    """`text` with control and format characters escaped (ESC as \\x1b, U+202E as \\u202e).

    Text from the cache was written elsewhere: printed as is, a terminal escape sequence in a note or a
    model name could rewrite the reader's terminal, and a bidirectional override could reorder the line.
    """
    if text.isprintable():
        return text
    return "".join(ch if ch == " " or unicodedata.category(ch) not in ("Cc", "Cf", "Zl", "Zp")
                   else ch.encode("unicode_escape").decode("ascii") for ch in text)


def _plan_from(d: Any) -> Plan:
    try:
        return Plan.from_dict(d)
    except (TypeError, ValueError) as exc:  # TypeError: a required field is missing
        raise ValueError(f"plan: {exc}") from None


def _trial_from(i: int, d: Any) -> Trial:
    try:
        if not isinstance(d, dict):
            raise ValueError(f"must be an object, got {type(d).__name__}")
        trial = Trial.from_dict(d)
    except (TypeError, ValueError) as exc:  # TypeError: a rung field unknown, or a required one missing
        raise ValueError(f"trials[{i}]: {exc}") from None
    if not isinstance(trial.note, str):  # printed by `autotune run` when the refusal is served
        raise ValueError(f"trials[{i}]: note must be a string, got {type(trial.note).__name__}")
    return dataclasses.replace(trial, note=printable(trial.note))


def _check_split(d: Any) -> None:
    """Refuse a plan whose split of the batch would not fit in memory, before `Plan` builds it."""
    config = d.get("config") if isinstance(d, dict) else None
    if not isinstance(config, dict):
        return  # `Plan.from_dict` says why
    sizes: list[Any] = [config.get(name) for name in ("global_batch_size", "world_size", "micro_batch_size")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes):
        return
    global_batch, world, micro = sizes
    steps = -(-(global_batch // world) // micro)
    if steps > MAX_MICRO_BATCHES:
        raise ValueError(f"plan splits a global batch of {global_batch:,} over {world} rank(s) into {steps:,} "
                         f"micro-batches of {micro} per step, over the {MAX_MICRO_BATCHES:,} a plan may have")


def _check_time(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a row may hold")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as infinity, which no plan field may hold
        raise ValueError(f"{text[:20]} is not a number a row may hold")
    return value


def _depth(value: Any) -> int:
    """How deeply `value` nests lists and objects (a scalar is 0), without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            if level > MAX_DEPTH:
                return level
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest
