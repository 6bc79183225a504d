"""`autotune.fit`: devices -> cache -> controller -> cache.

It resolves the settings, looks the workload up in the plan cache, and on a miss runs the search with
trials that snapshot the model, optimizer and RNG first and restore them in `finally`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .supervisor import agent
from .workload import batch as batches
from .cache import store as plan_cache
from .cache.rows import MEASURED_HERE, check_plan_matches, check_plan_sane, printable, sanitized
from . import parallel as distributed
from .workload.batching import per_rank_batch, split_sizes
from .search.controller import FIT_ADVICE, NOISE, Controller, Lattice, SearchResult
from .search import host_budget, offload_overlap, partitioned_state, reduce_timing
from .search.offload_share import choose_offload_fraction, offload_rival
from .search.flops import flops_per_sample, utilization
from .devices.peaks import device_peak
from .devices import host as host_memory
from .devices.headroom import fits, neighbour_budgets, shortfall, stable_budget
from .devices.placement import Placement, check_budget, default_budget, refuse_meta, resolve_device
from .errors import DeviceError, InvalidSetting, NoFeasiblePlan
from .workload import chunked_loss
from .workload.losses import chunked_default_loss, remember_fit_loss, resolve as resolve_loss
from .workload.optimizers import OptimizerSpec, check_optimizer, state_tensors_per_parameter
from .configuration import Rung
from .evidence import Trial
from .plan import Plan
from .sizes import format_bytes, parse_bytes, shorten
from .settings import FitSettings
from .training.recovery import engine_rung, report_recoveries_to
from .search.progress import Progress, progress_for
from .search.snapshot import Snapshot
from .techniques import (anchors, drop_rungs_over, dtype_conflict, eight_bit_anchors, find_blocks, is_float64,
                         keep_dtype, parse_techniques, profile_blocks, resident_floor, serve_dtypes)
from .techniques.offload import norm_parameters, overlap_default
from .techniques.offload.streamed import streams
from .techniques.offload import partition as offload_partition
from .techniques.compile import unavailable as compile_unavailable
from .techniques.sharding import choose_sharding, is_sharded, sharded_copy
from .search.trial import TrialRunner, Workload, noise_note

log = logging.getLogger(__name__)

# When nothing fits in a job of `autotune run` (cooperative): its --budget is the budget, unless the script
# passes its own to fit.
RUN_ADVICE = ("Raise --budget (or the memory_budget the script passes to fit), allow more techniques in the "
              "script's fit call (techniques=('bf16', 'checkpointing', 'offload')), or shrink the model or the "
              "sequence.")


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
            trials run the example tiled out to it, so no length training sees can pass the plan's peak.
        device: "cuda", "cuda:1" or "cpu" (the same search under a simulated ceiling of memory_budget).
        cache: a path, an `autotune.PlanCache`, or False; default $AUTOTUNE_CACHE or the user cache.
        techniques: allowed knobs, a subset of ("bf16", "checkpointing", "offload", "compile",
            "optimizer_8bit", "chunked_loss"); default all but the opt-in "optimizer_8bit" (AdamW with
            8-bit state) (compile is searched on CUDA only; "chunked_loss" computes a Hugging Face causal
            LM's head and loss a chunk of tokens at a time when loss_fn is None). A float64 model is tuned
            without bf16 autocast unless `techniques` names "bf16" (the default does not count for it).
        margin: fraction of the budget kept free (default 0.1).
        retune: ignore a cached plan and tune again.
        trial_steps: measured optimizer steps per trial (after one warm-up step).
        max_trials: stop the search after this many trials.
        progress: None (default): a live line per trial on a terminal, else plain lines through the
            `autotune` logger; True: always a line per trial on stderr; False: nothing.

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
    started = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise InvalidSetting(f"model must be a torch.nn.Module, got {type(model).__name__}")
    refuse_meta(model)
    check_optimizer(optimizer, model)  # before the cache: a hit must not serve an optimizer that trains nothing
    settings = FitSettings.resolve(global_batch_size=global_batch_size, memory_budget=memory_budget,
                                   host_memory_budget=host_memory_budget, max_length=max_length, margin=margin, device=device, cache=cache, techniques=techniques,
                                   measured_steps=trial_steps, max_trials=max_trials, retune=retune)
    placement = resolve_device(settings.device)
    batch = _at_max_length(batch, settings.max_length)
    store = plan_cache.open_cache(settings.cache)
    try:
        plan = _fit(model, batch, optimizer, loss_fn, settings, placement, store, progress)
    finally:
        if store is not None and store is not settings.cache:
            store.close()  # fit opened it: no connection outlives fit (the plan's store reopens if a recovery writes)
    remember_fit_loss(model, loss_fn)  # plan.apply(model, ...) trains with the loss fit tuned with
    if store is not None and plan.key:
        report_recoveries_to(plan.key, _recorder(store))  # a recovery in training is recorded in this cache
    if plan.source == "tuned":
        log.info("autotune: %s (%s) in %.1f s, %d trials", plan.summary(), plan.reason,
                 time.perf_counter() - started, len(plan.trials))
    agent.report_plan(plan)
    return plan


def _fit(model: nn.Module, batch: Any, optimizer: Any, loss_fn: Any, settings: FitSettings, placement: Placement,
         store: plan_cache.PlanCache | None, progress: Any) -> Plan:
    """The cached plan when one still fits, else a search (whose result, or its failure, is cached)."""
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
                                 max_micro_batch=settings.max_micro_batch)
    key = plan_cache.plan_key(parts)

    if store is not None and not settings.retune:
        def verify(plan: Plan) -> Trial:
            return _verify(plan, model, batch, optimizer, loss_fn, settings, placement, allowed, per_rank, world)

        hit = _cached(store, parts, settings, placement, budget_now, verify)
        if hit is not None:
            return hit
        _raise_if_nothing_fits(store, key)
    bound = store.max_safe_micro_batch(key) if store is not None else None
    if settings.max_micro_batch is not None:
        bound = min(bound or settings.max_micro_batch, settings.max_micro_batch)

    log.info("autotune: tuning on %s with a %s budget (%s), global batch %d over %d rank(s)",
             placement.name, format_bytes(budget), budget_source, global_batch, world)
    try:
        plan = _tune(model, batch, optimizer, loss_fn, settings, placement, budget, allowed, global_batch,
                     per_rank, world, bound, progress_for(progress) if distributed.is_writer() else None)
    except NoFeasiblePlan as exc:
        # Cached only when the search ran to its end: one cut short by max_trials may find a plan with more.
        if store is not None and distributed.is_writer() and len(exc.trials) < settings.max_trials:
            store.record_nothing_fits(parts, str(exc), exc.trials)
        raise
    if plan.sharding == "fsdp2" and not is_sharded(model):
        # The sharded copy the trials ran on holds reference cycles (FSDP's hooks): free its device shards
        # now, before the model is trained beside them.
        gc.collect()
        if placement.kind == "cuda":
            torch.cuda.empty_cache()
    # A plan carries its key only when it is cached: a recovery during training writes back by key, to `store`.
    plan = dataclasses.replace(plan, key=key if store is not None else "")
    if store is not None and distributed.is_writer():
        store.put(plan, parts)
    return plan


def _recorder(store: plan_cache.PlanCache) -> Any:
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


def host_limit(settings: FitSettings) -> int:
    """The host bytes a tune and its plan may use: `host_memory_budget`, else what this process may use now."""
    if settings.host_memory_budget is not None:
        return parse_bytes(settings.host_memory_budget, "host_memory_budget")
    return host_memory.default_budget()


def _cached(store: plan_cache.PlanCache, parts: dict[str, Any], settings: FitSettings, placement: Placement,
            budget_now: int, verify: Callable[[Plan], Trial]) -> Plan | None:
    """The cached plan for `parts`, if one still fits today's memory.

    Under a default budget, the plans of the neighbouring budget steps serve too when their peak fits under
    today's reading less the margin. Under an explicit `memory_budget` the user's figure stands, and a plan
    whose peak no longer fits the memory usable now is served with a warning naming both figures. A plan
    not measured on this machine (imported, or a teammate's) is served only once `verify` ran it (`_trusted`).
    """
    explicit = settings.memory_budget is not None
    budgets = [parts["budget_bytes"]] if explicit else neighbour_budgets(parts["budget_bytes"], placement.total_bytes)
    for budget in budgets:
        key = plan_cache.plan_key({**parts, "budget_bytes": budget})
        hit = store.get(key)
        if hit is None or not (explicit or fits(hit.peak_memory_bytes, settings.margin, budget_now)):
            continue
        if (hit.host_peak_bytes or 0) > host_limit(settings):  # tuned where the host had more room: tune here
            continue
        hit = _trusted(store, key, {**parts, "budget_bytes": budget}, hit, verify)
        if hit is None:
            continue
        log.info("plan cache hit %s: %s", key[:12], hit.summary())
        if explicit:
            short = shortfall(hit.peak_memory_bytes, placement, "the cached plan")
            if short is not None:
                log.warning("autotune: %s", short)
        return dataclasses.replace(hit, source="cache")
    return None


def _trusted(store: plan_cache.PlanCache, key: str, parts: dict[str, Any], hit: Plan,
             verify: Callable[[Plan], Trial]) -> Plan | None:
    """`hit` as it may be served, or None (then the search runs).

    A plan measured on this machine is served as stored. One from elsewhere is a claim: it must be a
    configuration its key allows with numbers a measurement could give, and one trial of it here must fit;
    a plan whose trial does not is marked unsafe, so neither this cache nor the team directory serves it again.
    """
    origin = _origin(store, key, hit)
    hit = sanitized(hit)  # a row imported before its text was escaped on reading
    if origin in MEASURED_HERE:
        return hit
    try:
        check_plan_matches(hit, key, parts)
        check_plan_sane(hit, parts)
    except ValueError as exc:
        log.warning("autotune: %s", printable(f"not serving the cached plan {key[:12]} from {origin}: {exc}"))
        return None
    log.info("autotune: %s", printable(f"verifying the cached plan {key[:12]} from {origin} with one trial"))
    trial = verify(hit)
    if trial.fits:
        clause = f"verified here by one trial (a plan from {origin}, peak {format_bytes(trial.peak_bytes)})"
        return dataclasses.replace(hit, peak_memory_bytes=trial.peak_bytes, trials=(*hit.trials, trial),
                                   reason=printable(f"{hit.reason}; {clause}"))
    what = f"{trial.outcome}{f' ({trial.note})' if trial.note else ''}"
    store.mark_unsafe(key, micro_batch_size=hit.micro_batch_size, note=shorten(printable(
        f"verification trial: {what}; a plan from {origin}"), 200))
    log.warning("autotune: %s", printable(
        f"the cached plan {key[:12]} from {origin} ({hit.rung.name} at micro-batch {hit.micro_batch_size}) did not "
        f"fit in a trial here: {what}; marked unsafe, tuning instead"))
    return None


def _origin(store: plan_cache.PlanCache, key: str, plan: Plan) -> str:
    """Where the plan `store.get(key)` returned came from: this cache's row (its origin), else the team directory."""
    for entry in store.entries(key):
        if entry.key == key and entry.plan is not None and dataclasses.replace(entry.plan, key=key) == plan:
            return entry.origin
    return store.team.origin if store.team is not None else "an unknown source"


def _verify(plan: Plan, model: nn.Module, batch: Any, optimizer: Any, loss_fn: Any, settings: FitSettings,
            placement: Placement, allowed: frozenset[str], per_rank: int, world: int) -> Trial:
    """One trial of `plan`'s configuration at its micro-batch, on the model as training will run it (an FSDP2
    plan on a sharded copy), leaving the model, optimizer and RNG as they were (as `_tune` does)."""
    conflict = dtype_conflict(plan.rung, model)
    if conflict is not None:  # such a rung crashes in its first step: the search never tries it either
        return Trial(rung=plan.rung, micro_batch_size=plan.micro_batch_size, outcome="error", note=conflict)
    spec = OptimizerSpec.from_user(optimizer, model)
    copied = plan.sharding == "fsdp2" and not is_sharded(model)
    home = _device_of(model)
    away = torch.device("cpu") if copied else placement.torch_device
    snapshot = Snapshot.take(model, optimizer)
    poisoned = False
    try:
        if home != away:
            model.to(away)
        tuned = sharded_copy(model, plan.precision) if copied else model
        if is_sharded(tuned):
            distributed.guard_collectives(tuned)
        example = batches.detached(batches.to_device(batch, placement.torch_device))
        loss = resolve_loss(loss_fn, tuned, chunked="chunked_loss" in allowed)
        work = Workload(model=tuned, batch=example, loss_fn=loss, spec=spec, placement=placement,
                        budget_bytes=plan.memory_budget_bytes,
                        limit_bytes=int((1 - plan.margin) * plan.memory_budget_bytes), per_rank=per_rank,
                        world_size=world, blocks=find_blocks(tuned, plan.block_paths),
                        warmup_steps=settings.warmup_steps, measured_steps=settings.measured_steps)
        rung, fraction = engine_rung(plan)  # the sharded optimizer state runs as offload with nothing on the host
        trial = TrialRunner(work, agree=distributed.agree_trial)(rung, plan.micro_batch_size,
                                                                  offload_fraction=fraction,
                                                                  overlap=plan.offload_overlap is True)
        del tuned, work, loss
    except DeviceError as error:
        poisoned = True
        _put_back_noting(error, model, home, snapshot)
        raise
    finally:
        if not poisoned:
            _put_back(model, home, snapshot)
    if copied:  # the sharded copy holds reference cycles (FSDP's hooks): free its device shards now
        gc.collect()
        if placement.kind == "cuda":
            torch.cuda.empty_cache()
    return trial


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


def _tune(model: nn.Module, batch: Any, optimizer: Any, loss_fn: Any, settings: FitSettings,
          placement: Placement, budget: int, allowed: frozenset[str], global_batch: int, per_rank: int,
          world: int, bound: int | None, progress: Progress | None = None) -> Plan:
    spec = OptimizerSpec.from_user(optimizer, model)
    peak = device_peak(placement.name, placement.kind)  # before the search: a bad $AUTOTUNE_PEAK_TFLOPS fails fast
    limit = int((1 - settings.margin) * budget)
    compile_notes: list[str] = []
    state_tensors = state_tensors_per_parameter(spec)
    plain = anchors(allowed, placement, find_blocks(model))[0][0]  # the first rung: nothing offloaded
    sharding, sharding_reason = choose_sharding(model, resident_floor(plain, model, state_tensors), limit, world)
    copied = sharding == "fsdp2" and not is_sharded(model)
    home = _device_of(model)
    # The trials run on the model moved to the device, or, for a plan that shards it, on a sharded copy
    # (sharding is in place and for good, and fit leaves the model as it found it) while the model waits
    # on the host, where the trials' peaks do not count it.
    away = torch.device("cpu") if copied else placement.torch_device
    snapshot = Snapshot.take(model, optimizer)
    poisoned = False
    tuned = model
    try:
        if home != away:
            model.to(away)
        if copied:
            tuned = sharded_copy(model, plain.precision)
        if is_sharded(tuned):
            distributed.guard_collectives(tuned)  # a trial's OOM on one rank stops every rank at one collective
        # Trials backpropagate into their own leaves, never into the user's inputs (a tensor with
        # requires_grad=True keeps its .grad); a loss that differentiates by its inputs still can.
        example, loss = batches.detached(batches.to_device(batch, placement.torch_device)), resolve_loss(
            loss_fn, tuned, chunked="chunked_loss" in allowed)
        # Which blocks, and in which order, by the activations they hold: one forward, so in the snapshot.
        # Not under FSDP2 (the profile reads parameter storages, which shards wrap): structural order there.
        profiled = "checkpointing" in allowed and not is_sharded(tuned)
        blocks = (profile_blocks(tuned, example, loss, placement) if profiled
                  else find_blocks(tuned))  # sharding's units; and the model's own checkpointing, reported
        rungs, notes = anchors(allowed, placement, blocks, float64=is_float64(tuned))
        notes += _loss_notes(loss_fn, loss, tuned, allowed)
        rungs, more = eight_bit_anchors(rungs, allowed, spec, placement.kind)
        notes += more
        rungs, dtype_notes = serve_dtypes(rungs, model)  # a rung that cannot train the model's dtypes is never tried
        notes = dtype_notes + notes
        floors = [resident_floor(r, tuned, state_tensors) for r in rungs]
        lattice = Lattice(blocks=len(blocks.blocks) if blocks is not None else 0,
                          shares=blocks.shares() if blocks is not None else None,
                          compile=_compile_allowed(allowed, placement, compile_notes, is_sharded(tuned)), floors=dict(zip(rungs, floors)))
        rungs, dropped = drop_rungs_over(rungs, floors, limit)  # floors count what this rank holds: its shard
        host = host_limit(settings)  # read once: the default follows the machine's free memory
        rungs, host_notes = host_budget.keep_within(rungs, tuned, spec, placement.kind, host)
        dropped += host_notes
        work = Workload(model=tuned, batch=example,
                        loss_fn=loss, spec=spec, placement=placement, budget_bytes=budget,
                        limit_bytes=limit, per_rank=per_rank, world_size=world, blocks=blocks,
                        warmup_steps=settings.warmup_steps, measured_steps=settings.measured_steps,
                        host_limit_bytes=host)
        flops = flops_per_sample(tuned, work.batch, work.loss_fn, placement)
        runner = TrialRunner(work, agree=distributed.agree_trial)
        longer = lambda rung, micro: runner(rung, micro, measured_steps=2 * work.measured_steps)  # noqa: E731
        if progress is not None:
            runner, longer = progress.watch(runner), progress.watch(longer, "re-measure")  # type: ignore[assignment]
        controller = Controller(runner, per_rank=per_rank, limit_bytes=limit, max_micro=bound,
                                max_trials=settings.max_trials, world_size=world, remeasure=longer,
                                advice=RUN_ADVICE if agent.result_path() is not None else FIT_ADVICE)
        controller.notes.extend(dropped)  # in the plan's reason, and in the error if nothing fits
        result = controller.search(rungs, lattice)
        best, fraction = _offload_share(result, runner, tuned, spec, limit, is_sharded(tuned), per_rank)
        best, fraction = _partitioned_state(result, controller, runner, best, fraction, work, is_sharded(tuned),
                                            allowed)
        best, overlap = _offload_overlap(result, best, fraction, runner, work, is_sharded(tuned))
        best, reduce_overlap = _reduce_timing(result, best, fraction, runner, work, is_sharded(tuned))
    except DeviceError as error:
        poisoned = True
        _put_back_noting(error, model, home, snapshot)
        raise
    finally:
        if progress is not None:
            progress.close()
        if not poisoned:
            _put_back(model, home, snapshot)
    sizes = split_sizes(per_rank, best.micro_batch_size, result.smallest)  # balanced when a 1 would be left
    tokens = batches.tokens_per_sample(batch)
    # Why micro-batch 1 was skipped comes first (it shapes the split), then why rungs were left out.
    first = [n for n in result.notes if n.startswith("micro-batch 1 skipped")]
    rest = [n for n in [*notes, *result.notes, *compile_notes] if n not in first]
    reason = result.reason + "".join(f"; {n}" for n in [*first, *rest][:2 + len(first)])
    if sharding_reason:  # the first decision: it changed what every trial ran on
        reason = f"{sharding_reason}; {reason}"
    if work.loss_form is not None and work.loss_form.note:  # never cut: what of the loss was weighted whole
        reason += f"; {work.loss_form.note}"
    if noise_note(result.trials):  # after the notes, never cut: the one thing that says how far to trust this
        reason += f"; {noise_note(result.trials)}"
    sharded_state = best.rung.offload == "optimizer" and fraction == 0.0  # nothing on the host: the state sharded
    if sharded_state:
        sharding, fraction = "optimizer_state", None
    return Plan(precision=best.rung.precision, checkpointing=best.rung.checkpointing,
                offload="none" if sharded_state else best.rung.offload, offload_fraction=fraction, offload_overlap=overlap, optimizer_8bit=best.rung.optimizer_8bit,
                checkpointed_blocks=best.rung.checkpointed_blocks, compile=best.rung.compile,
                block_paths=tuple(blocks.paths) if blocks is not None else (),
                compile_seconds=sum(t.compile_seconds for t in result.trials),
                micro_batch_size=sizes[0], accumulation_steps=len(sizes),
                world_size=world, global_batch_size=global_batch, last_micro_batch_size=sizes[-1],
                peak_memory_bytes=best.peak_bytes, memory_budget_bytes=budget, margin=settings.margin,
                samples_per_second=best.samples_per_second,
                tokens_per_second=best.samples_per_second * tokens if tokens else None,
                device=placement.kind, device_name=placement.name, source="tuned", reason=reason,
                trials=tuple(result.trials), flops_per_sample=flops, sharding=sharding, reduce_overlap=reduce_overlap,
                mfu=utilization(flops, best.samples_per_second, world, peak, best.rung.precision),
                min_micro_batch_size=result.smallest, techniques=tuple(sorted(allowed)), max_length=tokens,
                host_peak_bytes=host_budget.need(best.rung, model, spec, placement.kind, fraction=fraction or 1.0,
                                                 overlap=overlap, snapshot=False).total)


def _offload_share(result: SearchResult, runner: TrialRunner, model: nn.Module, spec: OptimizerSpec, limit: int,
                   sharded: bool, per_rank: int) -> tuple[Trial, float | None]:
    """Under optimizer offload, the smallest host share that fits the chosen micro-batch (not over FSDP2:
    sharded ranks hold a share of each parameter already). Adds its trials and note to `result`.

    Replicated ranks choose it too, alike: every rank runs the same share trials, whose outcomes the ranks
    agree on (`TrialRunner`'s `agree`), and the arithmetic is the same on each. Left at the whole model, two
    H100s streamed all of GPT-2 medium's optimizer state every step (RESULTS.md, fourth session).

    When the search picked a configuration without optimizer offload, its fastest offload rival is priced
    at a share too (`offload_rival`) and replaces the pick only if it is faster by more than noise."""
    best = result.best
    if sharded:
        return best, None
    candidate = best if best.rung.offload == "optimizer" else offload_rival(result.trials, best, per_rank, NOISE)
    if candidate is None:
        return best, None
    trainable = [p for p in model.parameters() if p.requires_grad]
    params = [trainable[i] for i in spec.held()]  # what the host optimizer splits: the parameters it trains
    chosen, fraction, ran, notes = choose_offload_fraction(
        candidate, lambda f: runner(candidate.rung, candidate.micro_batch_size, offload_fraction=f), params, limit,
        state_tensors_per_parameter(spec), norm_parameters(model),
        ranks=offload_partition.ranks(candidate.rung.precision, sharded))
    result.trials.extend(ran)
    if candidate is not best:
        return _rival_or_pick(result, best, chosen if chosen is not candidate else None, fraction)
    result.notes.extend(notes)
    if chosen is not best:
        result.reason = f"{result.reason}; {notes[0]}"
    return chosen, fraction


def _partitioned_state(result: SearchResult, controller: Controller, runner: TrialRunner, best: Trial,
                       fraction: float | None, work: Workload, sharded: bool,
                       allowed: frozenset[str]) -> tuple[Trial, float | None]:
    """On replicated ranks, the pick with the optimizer state partitioned over them (nothing on the host) and
    the configuration the room that frees lets fit, where that measured faster by more than noise
    (search/partitioned_state.py); else the pick as it was."""
    world = work.world_size
    if not partitioned_state.eligible(best, world, sharded, state_tensors_per_parameter(work.spec), allowed):
        return best, fraction

    def run(rung: Rung, micro: int) -> Trial:
        return runner(rung, micro, offload_fraction=0.0 if rung.offload == "optimizer" else 1.0,
                      measured_steps=partitioned_state.LONGER * work.measured_steps)

    winner, judged = partitioned_state.price(result, best, controller, run, world)
    if winner is None:
        return best, fraction
    result.reason = partitioned_state.reason(winner, judged, world, result.reason)
    return winner, 0.0


def _rival_or_pick(result: SearchResult, best: Trial, shared: Trial | None, fraction: float) -> tuple[Trial, float | None]:
    """The search's pick, or the offload rival at its share where that measured faster by more than noise."""
    if shared is None or shared.samples_per_second <= best.samples_per_second * (1 + NOISE):
        what = (f"{shared.samples_per_second:,.1f} samples/s with {fraction:.0%} of the parameters' optimizer on "
                "the host" if shared is not None else "no share on the device fitted")
        result.notes.append(f"optimizer offload priced at a partial share: {what}, not faster than the pick")
        return best, None
    result.reason = (f"{shared.rung.name} at micro-batch {shared.micro_batch_size} with {fraction:.0%} of the "
                     f"parameters' optimizer on the host: {shared.samples_per_second / best.samples_per_second:.2f}x "
                     f"{best.rung.name} at micro-batch {best.micro_batch_size}, the pick with the whole optimizer "
                     f"offloaded or none; then: {result.reason}")
    return shared, fraction


def _offload_overlap(result: SearchResult, best: Trial, fraction: float | None, runner: TrialRunner,
                     work: Workload, sharded: bool) -> tuple[Trial, bool | None]:
    """Under optimizer offload on one process, whether the host steps during the last backward: one trial
    of the chosen configuration with its measured steps overlapped (search/offload_overlap.py). Returns the
    trial to plan from and `plan.offload_overlap`: None where it is not a choice (no host optimizer, several
    ranks, FSDP2 shards, the overlap turned off)."""
    if best.rung.offload != "optimizer" or work.world_size != 1 or sharded or not overlap_default():
        return best, None
    overlapped = host_budget.need(best.rung, work.model, work.spec, work.placement.kind, fraction=fraction or 1.0,
                                  overlap=True)
    if work.host_limit_bytes is not None and overlapped.total > work.host_limit_bytes:
        result.reason = (f"{result.reason}; serial optimizer offload: overlapped, the host would hold "
                         f"{format_bytes(overlapped.total)}, over the host budget of "
                         f"{format_bytes(work.host_limit_bytes)}")
        return best, False
    other = runner(best.rung, best.micro_batch_size, offload_fraction=fraction or 1.0, overlap=True)
    result.trials.append(other)
    streamed = streams(work.placement.kind, work.spec.cls_name, best.rung.precision)
    best, overlap, clause = offload_overlap.choose(best, other, work.per_rank, streamed)
    result.reason = f"{result.reason}; {clause}"
    return best, overlap


def _reduce_timing(result: SearchResult, best: Trial, fraction: float | None, runner: TrialRunner,
                   work: Workload, sharded: bool) -> tuple[Trial, bool | None]:
    """On replicated ranks, whether the gradient all-reduce runs in buckets during the last backward or in one
    after it: one trial of the pick timing both (search/reduce_timing.py). None where autotune all-reduces
    nothing (one rank, FSDP2 shards)."""
    if not reduce_timing.eligible(work.world_size, sharded):
        return best, None
    timed = runner(best.rung, best.micro_batch_size, reduce_pairs=reduce_timing.PAIRS,
                   offload_fraction=fraction if best.rung.offload == "optimizer" and fraction is not None else 1.0)
    result.trials.append(timed)
    chosen, overlap, clause = reduce_timing.choose(best, timed, work.per_rank, work.world_size)
    result.reason = f"{result.reason}; {clause}"
    return chosen, overlap


def _put_back(model: nn.Module, home: torch.device, snapshot: Snapshot) -> None:
    """The model back on its own device, with the weights, optimizer state and RNG it came with."""
    if _device_of(model) != home:
        model.to(home)
    snapshot.restore()


def _put_back_noting(error: DeviceError, model: nn.Module, home: torch.device, snapshot: Snapshot) -> None:
    """`_put_back` after a poisoned CUDA context: it calls CUDA, which fails again, and that failure must not
    replace the `DeviceError` that says why. It is logged and noted on the error instead."""
    try:
        _put_back(model, home, snapshot)
    except Exception as exc:  # noqa: BLE001 - the DeviceError is what the user must see
        text = f"restoring the model afterwards failed too ({type(exc).__name__}: {exc}); restart the process"
        log.warning("autotune: %s", text)
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(text)


def _loss_notes(loss_fn: Any, loss: Any, model: nn.Module, allowed: frozenset[str]) -> list[str]:
    """Why the model's own loss is (or is not) computed a chunk of tokens at a time."""
    if loss_fn is not None or "chunked_loss" not in allowed:
        return []
    if loss is chunked_default_loss:
        return ["chunked_loss: the LM head's logits and loss a chunk of tokens at a time (no full logits held)"]
    why = chunked_loss.why_not(model)
    hf = getattr(chunked_loss.unwrapped(model), "lm_head", None) is not None
    return [f"chunked_loss skipped: {why}"] if hf and why else []


def _compile_allowed(allowed: frozenset[str], placement: Placement, notes: list[str], sharded: bool) -> bool:
    """Whether the search may try compile; when it may not although allowed, a note says why."""
    if "compile" not in allowed:
        return False
    # Not on FSDP2 shards: a compiled block of a sharded GPT-2 XL killed both ranks with "an illegal memory
    # access" on two H200s (torch 2.11, RESULTS.md "Several GPUs"); compile there is left to a later issue.
    why = "compile is not tried on an FSDP2-sharded model" if sharded else compile_unavailable(placement)
    if why is not None:
        notes.append(why)
    return why is None


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
