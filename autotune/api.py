"""`autotune.fit`: settings -> plan cache lookup -> search -> plan cache put.

It resolves the settings, looks the workload up in the plan cache (a plan from elsewhere is verified by one
trial first), and on a miss runs the search (`search/tune.py`), caching its plan or that nothing fits.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import parallel as distributed
from . import settings as variables
from .cache import store as plan_cache
from .cache.rows import MEASURED_HERE, check_plan_matches, check_plan_sane, printable, sanitized
from .devices import allocator
from .devices.headroom import fits, neighbour_budgets, shortfall, stable_budget
from .devices.peaks import device_peak
from .devices.placement import Placement, check_budget, default_budget, refuse_meta, resolve_device
from .errors import InvalidSetting, NoFeasiblePlan
from .evidence import Finding, Trial
from .parallel.deaths import named_deaths
from .plan import Plan
from .search.anchors import keep_dtype
from .search.deadline import Deadline
from .search.flops import utilization
from .search.progress import progress_for
from .search.tune import Job, explicit_host_budget, host_limit, tune, verify
from .search.tune_time import Laps, account_of, timed
from .settings import FitSettings
from .sizes import format_bytes, parse_bytes, shorten
from .techniques import parse_techniques
from .techniques.precision import choose_precision
from .training.learned import Learned
from .workload import batch as batches
from .workload import check_device, loss_checks
from .workload.batching import per_rank_batch
from .workload.optimizers import check_optimizer

log = logging.getLogger(__name__)


@named_deaths()  # a rank that dies mid-tune is named by node and local rank on the others
def fit(
    model: nn.Module,
    batch: Any,
    *,
    global_batch_size: int | None = None,
    optimizer: Any = None,
    loss_fn: Any = None,
    memory_budget: int | str | None = None,
    host_memory_budget: int | str | None = None,
    max_length: int | None = None,
    device: str | torch.device | None = None,
    cache: Any = None,
    techniques: Any = None,
    margin: float | None = None,
    retune: bool | None = None,
    trial_steps: int | None = None,
    max_trials: int | None = None,
    progress: bool | None = None,
    max_tune_seconds: float | None = None,
) -> Plan:
    """Find the fastest plan that fits: precision, checkpointing, offload, micro-batch and accumulation.

    Args:
        model: the model to train, on the target device or the CPU (moved for the trials and back).
        batch: an example batch (Tensor, tuple/list or mapping of Tensors such as a dict or a tokenizer's
            BatchEncoding, batch dimension first). Never backpropagated into: inputs keep their .grad.
        global_batch_size: samples per optimizer step over all ranks; default $AUTOTUNE_GLOBAL_BATCH_SIZE,
            else the example batch's size times the world size.
        optimizer: None (AdamW), an optimizer (its class and hyperparameters are reused; it is never
            stepped), or a factory `params -> Optimizer`.
        loss_fn: `(model, batch) -> loss`; default `model(**batch).loss` or a scalar output.
        memory_budget: bytes or a string like "24GiB"; default what the device can give this process.
        host_memory_budget: host RAM the plan may use (offload's masters, moments and pinned buffers, and fit's
            copy of the model), bytes or a string like "96GiB"; default what this process may use (available
            memory, capped by a cgroup limit) less 10%. A configuration over it is never run.
        max_length: the longest sequence training will see, in tokens; default the example batch's. The
            trials run the example tiled out to it, so no length training sees can pass the plan's peak; the
            plan's throughput is measured on the example as given (one more trial, where it is shorter).
        device: "cuda", "cuda:1" or "cpu" (the same search under a simulated ceiling of memory_budget).
        cache: a path, an `autotune.PlanCache`, or False; default $AUTOTUNE_CACHE or the user cache.
        techniques: allowed knobs, a subset of ("bf16", "checkpointing", "offload", "compile",
            "optimizer_8bit", "chunked_loss", "fp8"); default all but the opt-ins "optimizer_8bit" (AdamW with
            8-bit state) and "fp8" (torchao's float8 matmuls in the linear layers, on CUDA compute capability
            8.9 and later; left out elsewhere with a note in the plan's reason) (compile is searched on CUDA
            only; "chunked_loss" computes a Hugging Face causal LM's head and loss a chunk of tokens at a time
            when loss_fn is None). A float64 model is tuned
            without bf16 autocast unless `techniques` names "bf16" (the default does not count for it).
        margin: fraction of the budget kept free (default 0.1).
        retune: ignore a cached plan and tune again.
        trial_steps: measured optimizer steps per trial (after one warm-up step).
        max_trials: stop the search after this many trials.
        progress: None (default): a live line per trial on a terminal, else plain lines through the
            `autotune` logger; True: always a line per trial on stderr; False: nothing.
        max_tune_seconds: a bound on the tune, from this call: once it has passed and a configuration fitted, no
            new trial starts, and the plan is the best measured (its reason says the search was cut short and
            what it left untried); default $AUTOTUNE_MAX_TUNE_SECONDS, else none. Such a plan is cached marked,
            and served only to a fit that bounds its tune too.

    Returns:
        The `Plan`, with `source` "tuned" or "cache".

    Raises:
        InvalidSetting: a setting is wrong (the message names it and the fix).
        NoFeasiblePlan: nothing fits even at micro-batch 1 on the top rung.
        DeviceError: a CUDA error that is not an OOM; restart the process.

    Example:
        >>> plan = autotune.fit(model, batch, global_batch_size=64, memory_budget="24GiB")
        >>> step = plan.apply(model, optimizer)
        >>> loss = step(global_batch)
    """
    laps = Laps()  # the tune's time outside its trials (the trials time their own phases)
    if not isinstance(model, nn.Module):
        raise InvalidSetting(f"model must be a torch.nn.Module, got {type(model).__name__}")
    refuse_meta(model)
    check_optimizer(optimizer, model)  # before the cache: a hit must not serve an optimizer that trains nothing
    settings = FitSettings.resolve(global_batch_size=global_batch_size, memory_budget=memory_budget,
                                   host_memory_budget=host_memory_budget, max_length=max_length, margin=margin,
                                   device=device, cache=cache, techniques=techniques,
                                   measured_steps=trial_steps, max_trials=max_trials, retune=retune,
                                   max_tune_seconds=max_tune_seconds)
    placement = resolve_device(settings.device)
    if not placement.simulated:  # before any trial: the trials measure under it, and training keeps it
        allocator.expand_in_process()
    longest = _at_max_length(batch, settings.max_length)
    typical = batch if longest is not batch else None  # throughput is measured at the example's own length
    # Before the search or a cached plan: what stands in for the user's loss is checked on the example first.
    with laps.phase("loss check"):
        checked = check_device.checked(model, placement, settings.memory_budget, distributed.world_size(), lambda:
            loss_checks.check_and_record(model, batch, loss_fn, chunked="chunked_loss" in parse_techniques(
                settings.techniques), agree=loss_checks.on_every_rank(distributed.sum_over_ranks,
                distributed.world_size()), together=lambda: distributed.leaving_together(model)))
    if checked.warning is not None:
        log.warning("autotune: %s", checked.warning)
    store = plan_cache.open_cache(settings.cache)
    try:
        plan = _fit(model, longest, optimizer, loss_fn, settings, placement, store, progress, typical, laps)
    finally:
        if store is not None and store is not settings.cache:
            store.close()  # fit opened it: no connection outlives fit (the plan's store reopens if a recovery writes)
    for note in checked.notes:  # once: a plan from the cache, or the search's own account, may say it already
        plan = plan.with_finding(Finding(kind="loss", clause=note), once=True)
    distributed.agree_on_plan(plan.config.to_dict())  # one plan on every rank, or an error naming the odd ones
    # plan.apply trains with the loss fit tuned with, and records a recovery in training in this cache
    plan = dataclasses.replace(plan, learned=Learned.of(
        loss_fn=loss_fn, report=_recorder(store) if store is not None and plan.key else None))
    if plan.source == "tuned":
        log.info("autotune: %s (%s); %s", plan.summary(), plan.reason, account_of(plan))
    for callback in _plan_callbacks:
        callback(plan)
    return plan


_plan_callbacks: list[Callable[[Plan], None]] = []


def on_plan(callback: Callable[[Plan], None]) -> None:
    """Call `callback(plan)` with every plan `fit` returns, tuned or cached (a job of `autotune run` records it)."""
    if callback not in _plan_callbacks:
        _plan_callbacks.append(callback)


def _recorder(store: plan_cache.PlanCache) -> Callable[[Plan, Plan | None, str, dict[str, list[int]]], None]:
    """What a recovery in training does to `store`: the old plan marked unsafe at its shapes, the new one stored
    under the same key. The store is closed again afterwards: training holds no connection between recoveries."""
    def record(old: Plan, new: Plan | None, note: str, shapes: dict[str, list[int]]) -> None:
        try:
            store.mark_unsafe(old.key, micro_batch_size=old.micro_batch_size, shapes=shapes, note=note)
            if new is not None:
                store.replace(old.key, new)
        finally:
            store.close()

    return record


def _fit(model: nn.Module, batch: Any, optimizer: Any, loss_fn: Any, settings: FitSettings, placement: Placement,
         store: plan_cache.PlanCache | None, progress: Any, typical: Any = None, laps: Laps | None = None) -> Plan:
    """The cached plan when one still fits, else a search (whose result, or its failure, is cached). `batch` is
    the example at `max_length`; `typical`, the example at its own length where that is shorter. `laps` times
    the tune's phases outside its trials, from fit's call."""
    laps = laps if laps is not None else Laps()
    example_size = batches.batch_size(batch)
    world = distributed.world_size()
    global_batch = settings.global_batch_size or example_size * world
    per_rank = per_rank_batch(global_batch, world)
    budget_now, budget_source = _budget(settings, placement)
    budget_now = distributed.smallest(budget_now)  # every rank searches under the same limit, so all decide alike
    # A default budget is a moving reading; the key holds it rounded to a stable step (devices/headroom.py).
    budget = budget_now if settings.memory_budget is not None else stable_budget(budget_now, placement.total_bytes)
    allowed = keep_dtype(parse_techniques(settings.techniques), model, settings.techniques)  # float64 stays
    parts = plan_cache.key_parts(model=model, batch=batch, global_batch_size=global_batch, world_size=world,
                                 placement=placement, budget_bytes=budget, techniques=allowed,
                                 margin=settings.margin, optimizer=optimizer, loss_fn=loss_fn,
                                 max_micro_batch=settings.max_micro_batch,
                                 host_budget_bytes=explicit_host_budget(settings),
                                 nodes=distributed.topology().nodes)
    key = plan_cache.plan_key(parts)

    job = Job(model=model, batch=batch, optimizer=optimizer, loss_fn=loss_fn, settings=settings, placement=placement,
              budget=budget, allowed=allowed, global_batch=global_batch, per_rank=per_rank, world=world,
              typical=typical, laps=laps, deadline=Deadline(seconds=settings.max_tune_seconds, started=laps.started))
    if store is not None and not settings.retune:
        check = _Verification(placement=placement, trial=lambda plan: verify(plan, job),
                             tokens_per_sample=batches.tokens_per_sample(batch), flops_at_trial_length=typical is None)
        with laps.phase("cache look-up"):
            hit = _cached(store, parts, settings, placement, budget_now, check)
            if hit is not None:
                return hit
            _raise_if_nothing_fits(store, key)
    bound = store.max_safe_micro_batch(key) if store is not None else None
    if settings.max_micro_batch is not None:
        bound = min(bound or settings.max_micro_batch, settings.max_micro_batch)

    log.info("autotune: tuning on %s with a %s budget (%s), global batch %d over %d rank(s)",
             placement.name, format_bytes(budget), budget_source, global_batch, world)
    shown = progress_for(progress) if distributed.is_writer() else None
    try:
        plan = tune(dataclasses.replace(job, bound=bound, progress=shown))
    except NoFeasiblePlan as exc:
        # Cached only when the search ran to its end: one cut short by max_trials may find a plan with more.
        if store is not None and distributed.is_writer() and len(exc.trials) < settings.max_trials:
            store.record_nothing_fits(parts, str(exc), exc.trials)
        raise
    plan = timed(plan, laps)
    if shown is not None:
        shown.finish(account_of(plan))
    # A plan carries its key only when it is cached: a recovery during training writes back by key, to `store`.
    # One cut short by max_tune_seconds is cached marked (`untried`), and served only to a fit bounded too.
    plan = plan.with_provenance(key=key if store is not None else "")
    if store is not None and distributed.is_writer():
        store.put(plan, parts)
    return plan


def _at_max_length(batch: Any, max_length: int | None) -> Any:
    """The example at the longest sequence training will see, so that no length it sees passes the plan's peak."""
    if max_length is None:
        return batch
    length = batches.tokens_per_sample(batch)
    if length is None:
        raise InvalidSetting("max_length applies to token batches (an integer tensor of shape (batch, length)) and "
                             "the example has none; leave max_length out")
    if max_length < length:
        raise InvalidSetting(f"max_length ({max_length}) is shorter than the example batch's {length} tokens; pass "
                             f"an example no longer than max_length, or raise max_length")
    return batches.lengthen(batch, max_length)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Verification:
    """How a plan from elsewhere is checked here before it is served: this device, one trial of the plan
    (`search.tune.verify`), and what turns that trial's rate into the plan's figures."""

    placement: Placement
    trial: Callable[[Plan], Trial]
    tokens_per_sample: int | None  # of the example the trial runs (at max_length); None for a batch of no tokens
    flops_at_trial_length: bool  # a plan's FLOPs per sample are counted at that length (no shorter example given)


def _cached(store: plan_cache.PlanCache, parts: dict[str, Any], settings: FitSettings, placement: Placement,
            budget_now: int, check: _Verification) -> Plan | None:
    """The cached plan for `parts`, if one still fits today's memory.

    Under a default budget, the plans of the neighbouring budget steps serve too when their peak fits under
    today's reading less the margin. Under an explicit `memory_budget` the user's figure stands, and a plan
    whose peak no longer fits the memory usable now is served with a warning naming both figures. A plan
    not measured on this machine (imported, or a teammate's) is served only once one trial of it ran here
    (`_trusted`).
    """
    explicit = settings.memory_budget is not None
    budgets = [parts["budget_bytes"]] if explicit else neighbour_budgets(parts["budget_bytes"], placement.total_bytes)
    for budget in budgets:
        key = plan_cache.plan_key({**parts, "budget_bytes": budget})
        hit = store.get(key)
        if hit is None or not (explicit or fits(hit.peak_memory_bytes, settings.margin, budget_now)):
            continue
        if hit.evidence.untried is not None and settings.max_tune_seconds is None:  # cut short: a full tune now
            continue
        if (hit.host_peak_bytes or 0) > host_limit(settings):  # tuned where the host had more room: tune here
            continue
        hit = _trusted(store, key, {**parts, "budget_bytes": budget}, hit, check)
        if hit is None:
            continue
        log.info("plan cache hit %s: %s", key[:12], hit.summary())
        if explicit:
            short = shortfall(hit.peak_memory_bytes, placement, "the cached plan")
            if short is not None:
                log.warning("autotune: %s", short)
        return hit.with_provenance(source="cache")
    return None


def _trusted(store: plan_cache.PlanCache, key: str, parts: dict[str, Any], hit: Plan,
             check: _Verification) -> Plan | None:
    """`hit` as it may be served, or None (then the search runs).

    A plan measured on this machine is served as stored. One from elsewhere is a claim: it must be a
    configuration its key allows, in the precision a search here would train in, with numbers a measurement
    could give, and one trial of it here must fit. A plan whose trial fits is served with the figures that
    trial measured, and an imported row is stored so (then measured here); one whose trial does not is marked
    unsafe, so neither this cache nor the team directory serves it again.
    """
    origin = _origin(store, key, hit)
    hit = sanitized(hit)  # a row imported before its text was escaped on reading
    if origin in MEASURED_HERE:
        return hit
    try:
        check_plan_matches(hit, key, parts)
        _check_precision(hit, check.placement)
        check_plan_sane(hit, parts)
    except ValueError as exc:
        log.warning("autotune: %s", printable(f"not serving the cached plan {key[:12]} from {origin}: {exc}"))
        return None
    log.info("autotune: %s", printable(f"verifying the cached plan {key[:12]} from {origin} with one trial"))
    trial = check.trial(hit)
    if trial.fits:
        verified = _as_measured(hit, trial, check, origin)
        if distributed.is_writer():
            store.keep_verified(key, verified, origin)
        return verified
    what = f"{trial.outcome}{f' ({trial.note})' if trial.note else ''}"
    store.mark_unsafe(key, micro_batch_size=hit.micro_batch_size, note=shorten(printable(
        f"verification trial: {what}; a plan from {origin}"), 200))
    log.warning("autotune: %s", printable(
        f"the cached plan {key[:12]} from {origin} ({hit.rung.name} at micro-batch {hit.micro_batch_size}) did not "
        f"fit in a trial here: {what}; marked unsafe, tuning instead"))
    return None


def _check_precision(plan: Plan, placement: Placement) -> None:
    """A 16-bit plan must train in the 16-bit type a search on this device picks: bf16 where the device has it,
    fp16 (with loss scaling) only where it does not. FP32 passes: it gives up no range or precision on any device,
    and the key already says whether 16 bits were allowed (`check_plan_matches`).

    Raises:
        ValueError: naming both precisions and why this device takes the other.
    """
    if plan.precision == "fp32":
        return
    wanted, why = choose_precision(True, placement)
    if plan.precision != wanted:
        raise ValueError(f"plan trains in {plan.precision}, and a search on this device picks {why}")


def _as_measured(plan: Plan, trial: Trial, check: _Verification, origin: str) -> Plan:
    """`plan` with what its verification `trial` measured here in place of the claims: peak, samples/s, tokens/s
    and MFU (from the plan's FLOPs per sample, where they are of the trial's length), and no real run's rate
    (that run was elsewhere); the trial joins its trials and its reason says so."""
    rate = trial.samples_per_second
    mfu = None
    if check.flops_at_trial_length:
        peak = device_peak(check.placement.name, check.placement.kind, variables.read(variables.PEAK_ENV))
        mfu = utilization(plan.flops_per_sample, rate, plan.world_size, peak, plan.precision)
    clause = (f"verified here by one trial (a plan from {origin}, peak {format_bytes(trial.peak_bytes)}, "
              f"{rate:,.1f} samples/s measured here)")
    verified = Finding(kind="verified", clause=printable(clause), subject=printable(origin),
                       figures={"peak_bytes": trial.peak_bytes, "samples_per_second": rate})
    return plan.with_evidence(peak_memory_bytes=trial.peak_bytes, samples_per_second=rate,
                              tokens_per_second=rate * check.tokens_per_sample if check.tokens_per_sample else None,
                              mfu=mfu, measured_samples_per_second=None, trials=(*plan.trials, trial)
                              ).with_finding(verified)


def _origin(store: plan_cache.PlanCache, key: str, plan: Plan) -> str:
    """Where the plan `store.get(key)` returned came from: this cache's row (its origin), else the team directory."""
    for entry in store.entries(key):
        if entry.key == key and entry.plan is not None and entry.plan.with_provenance(key=key) == plan:
            return entry.origin
    return store.team.origin if store.team is not None else "an unknown source"


def _raise_if_nothing_fits(store: plan_cache.PlanCache, key: str) -> None:
    """Raise the cached `NoFeasiblePlan` of an earlier search under `key` (here, imported, or a teammate's in
    the team directory), if there was one; the message names where the record came from."""
    record = store.nothing_fits(key)
    if record is None:
        return
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(record.time))
    where = record.origin if record.origin.startswith("team:") else f"{store.path} ({record.origin})"
    # The message may come from a teammate's file: control characters are escaped before anyone prints it.
    raise NoFeasiblePlan(printable(f"{record.message} (found by a search on {when}, cached under key {key[:12]} "
                                   f"in {where}; pass retune=True to search again)"), trials=record.trials)


def _budget(settings: FitSettings, placement: Placement) -> tuple[int, str]:
    if settings.memory_budget is not None:
        budget = check_budget(parse_bytes(settings.memory_budget), placement.total_bytes, placement.name)
        return budget, "memory_budget"
    return default_budget(placement)
