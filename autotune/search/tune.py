"""The search behind `fit` on a cache miss: the sharding decision, the anchors and the lattice, the controller's
steps over one `Ledger` (the steps after the pick included: `controller.AFTER_PICK`), and the plan with its
reason, composed once from the ledger they leave; and `verify`, one trial of a plan from elsewhere before it is
served."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .. import parallel as distributed
from .. import settings
from ..configuration import FSDP, Rung
from ..devices import allocator
from ..devices import host as host_memory
from ..devices.peaks import DevicePeak, device_peak
from ..devices.placement import Placement
from ..errors import NoFeasiblePlan
from ..evidence import Trial
from ..plan import Plan
from ..settings import FitSettings, result_file
from ..sizes import parse_bytes
from ..techniques import attention_lengths, dtype_conflict, find_blocks, is_float64, profile_blocks, serve_dtypes
from ..techniques.blocks import BlockGroup
from ..techniques.compile import graphs_note
from ..techniques.compile import unavailable as compile_unavailable
from ..techniques.host_need import snapshot_on_disk
from ..techniques.sharding import choose_sharding, is_sharded
from ..training.recovery import host_share
from ..workload import batch as batches
from ..workload import chunked_loss
from ..workload.batching import split_sizes
from ..workload.losses import chunked_default_loss
from ..workload.losses import resolve as resolve_loss
from ..workload.optimizers import OptimizerSpec, state_tensors_per_parameter
from . import heap, host_budget, kept_rung, typical
from .anchors import anchors, eight_bit_anchors, fp8_anchors
from .controller import FIT_ADVICE, AfterPick, Controller, Lattice
from .deadline import Deadline, OutOfTime
from .failures import Failures
from .floors import drop_rungs_over, fused_note, resident_floor, step_scratch
from .flops import FlopCount, count_flops, utilization
from .ground import Ground, trials_on
from .ledger import Ledger
from .offload_overlap import as_trained
from .plan_reason import findings
from .progress import Progress
from .sharding_choice import replicated_or_sharded, searched_beside, sharding_may_win, with_hybrid
from .trial import TrialRunner, Workload
from .tune_time import Laps

# When nothing fits in a job of `autotune run` (cooperative): its --budget is the budget, unless the script
# passes its own to fit.
RUN_ADVICE = ("Raise --budget (or the memory_budget the script passes to fit), allow more techniques in the "
              "script's fit call (techniques=('bf16', 'checkpointing', 'offload')), or shrink the model or the "
              "sequence.")


@dataclass(frozen=True, kw_only=True)
class Job:
    """One search: the user's model, example, optimizer and loss; the settings; the device and budget; the
    techniques allowed; the batch over ranks; the largest micro-batch the cache still trusts; progress lines.

    Large: a record, one field per input of one search, handed from `fit` to the search whole; no behaviour.
    """

    model: nn.Module
    batch: Any
    optimizer: Any
    loss_fn: Any
    settings: FitSettings
    placement: Placement
    budget: int
    allowed: frozenset[str]
    global_batch: int
    per_rank: int
    world: int
    bound: int | None = None
    progress: Progress | None = None
    typical: Any = None  # the example at its own length, where `batch` is it lengthened to max_length
    laps: Laps = field(default_factory=Laps)  # the tune's time outside its trials, from fit's call
    deadline: Deadline = field(default_factory=Deadline)  # max_tune_seconds


@dataclass(kw_only=True)
class _Setup:
    """What the search starts from: the anchors to climb, the lattice beyond them, and why rungs were left out."""

    rungs: list[Rung]
    lattice: Lattice
    blocks: BlockGroup | None
    notes: list[str]  # before the controller's own notes in the plan's reason
    dropped: list[str]  # the controller's first notes (in the error too, if nothing fits)
    compile_notes: list[str]


def explicit_host_budget(settings: FitSettings) -> int | None:
    """`host_memory_budget` in bytes, or None where the user gave none."""
    if settings.host_memory_budget is None:
        return None
    return parse_bytes(settings.host_memory_budget, "host_memory_budget")


def host_limit(settings: FitSettings) -> int:
    """The host bytes a tune and its plan may use: `host_memory_budget`, else what this process may use now."""
    explicit = explicit_host_budget(settings)
    return explicit if explicit is not None else host_memory.default_budget()


def tune(job: Job) -> Plan:
    """The fastest plan that fits `job`, from trials on the model (or a sharded copy), which is put back after.

    With two or more GPUs, a model that fits replicated only with blocks recomputed or state offloaded is
    also tuned sharded with FSDP2, and the faster of the two measured plans is kept (`replicated_or_sharded`):
    sharding frees the memory those techniques buy with time, at the cost of gathering each block's weights.
    Not on the simulated CPU device, whose timings say nothing about a GPU's collectives.
    """
    spec = OptimizerSpec.from_user(job.optimizer, job.model)
    # Before the search: a bad $AUTOTUNE_PEAK_TFLOPS fails fast.
    peak = device_peak(job.placement.name, job.placement.kind, settings.read(settings.PEAK_ENV))
    limit = int((1 - job.settings.margin) * job.budget)
    plain = anchors(job.allowed, job.placement, find_blocks(job.model))[0][0]  # the first rung: nothing offloaded
    scratch = step_scratch(spec, job.model, job.placement.torch_device.type)
    floor = resident_floor(plain, job.model, state_tensors_per_parameter(spec), scratch=scratch)
    sharding, sharding_reason = choose_sharding(job.model, floor, limit, job.world)
    to_disk = snapshot_on_disk(job.model)  # once: the snapshot's own file takes the disk room it asks for
    try:
        with heap.set_aside():
            plan = _tune_as(job, spec, peak, limit, plain.precision, sharding, sharding_reason, to_disk)
            hybrid = lambda: _tune_as(job, spec, peak, limit, plain.precision, "hsdp", "", to_disk)  # noqa: E731
            plan = with_hybrid(plan, job.model, hybrid)  # on several nodes, flat FSDP2 or hybrid, by measurement
            if job.placement.simulated or not sharding_may_win(plan, job.model, job.world) or job.deadline.passed():
                return plan
            sharded, plan = searched_beside(plan, "sharded with FSDP2", lambda: _tune_as(
                job, spec, peak, limit, plain.precision, "fsdp2", "", to_disk))
            return plan if sharded is None else replicated_or_sharded(plan, sharded)
    finally:
        if job.progress is not None:
            job.progress.close()


def _tune_as(job: Job, spec: OptimizerSpec, peak: DevicePeak, limit: int, precision: str, sharding: str,
             sharding_reason: str, snapshot_to_disk: bool) -> Plan:
    """One search with the model replicated (`sharding` "none") or sharded with FSDP2, and its plan."""
    copied = sharding in FSDP and not is_sharded(job.model)
    nodes = distributed.topology().nodes  # the plan's; the copy is sharded within each node under "hsdp"
    failures = Failures()
    with trials_on(job.model, job.optimizer, job.placement, copied=copied, precision=precision,
                   nodes=nodes if sharding == "hsdp" else 1,
                   snapshot_to_disk=snapshot_to_disk, laps=job.laps) as ground:
        found = _search_or_fp32(job, ground, spec, limit, not snapshot_to_disk, failures)
        at_typical = None if isinstance(found, BaseException) else _at_typical_length(job, found[0], found[2])
    if isinstance(found, BaseException):  # raised out here: the model is back as the user gave it, and the
        raise found  # exception (the model's own, where every configuration raised it) chains to nothing of ours
    state, setup, work, flops, fp32_note = found
    best = state.picked()
    tokens = batches.tokens_per_sample(job.batch)
    rate, per_token = best.samples_per_second, tokens
    if at_typical is not None:  # throughput at the example's length, the peak at max_length's
        rate, per_token, flops = at_typical.samples_per_second, at_typical.length, at_typical.flops
    best_rung = best.rung
    closing = _why_no_mfu(flops, peak, best_rung.precision, job.placement.kind)
    if best_rung.compile:
        closing.insert(0, graphs_note(setup.blocks, best_rung.checkpointed_blocks or 0, tokens is not None))
    loss_note = work.loss_form.note if work.loss_form is not None else ""
    said = findings(state, [*setup.notes, *state.notes, *setup.compile_notes, *closing],
                    first="; ".join(n for n in (sharding_reason, fp32_note) if n),
                    last=tuple(n for n in (failures.clause(best_rung.precision), loss_note, job.deadline.clause(
                        state.cut, len(state.trials), state.untried)) if n))
    fraction = state.fraction
    sizes = split_sizes(job.per_rank, best.micro_batch_size, state.smallest)  # balanced when a 1 would be left
    host_fraction = fraction or 1.0  # what the host holds, for its need below
    if best.sharding != "none":  # the optimizer state partitioned over the replicated ranks (partitioned_state)
        sharding = best.sharding
    return Plan.of(precision=best.rung.precision, checkpointing=best.rung.checkpointing,
                offload=best.rung.offload, offload_fraction=fraction,
                offload_overlap=state.overlap, optimizer_8bit=best.rung.optimizer_8bit, fp8=best.rung.fp8,
                checkpointed_blocks=best.rung.checkpointed_blocks, compile=best.rung.compile,
                block_paths=tuple(setup.blocks.paths) if setup.blocks is not None else (),
                compile_seconds=sum(t.compile_seconds for t in state.trials),
                micro_batch_size=sizes[0], accumulation_steps=len(sizes),
                world_size=job.world, global_batch_size=job.global_batch, last_micro_batch_size=sizes[-1],
                peak_memory_bytes=best.peak_bytes, memory_budget_bytes=job.budget, margin=job.settings.margin,
                samples_per_second=rate, tokens_per_second=rate * per_token if per_token else None,
                device=job.placement.kind, device_name=job.placement.name, source="tuned",
                account=state.head, findings=said,
                trials=tuple(state.trials), flops_per_sample=flops.per_sample, sharding=sharding,
                reduce_overlap=state.reduce_overlap, nodes=nodes,
                mfu=utilization(flops.per_sample, rate, job.world, peak, best.rung.precision),
                min_micro_batch_size=state.smallest, techniques=tuple(sorted(job.allowed)), max_length=tokens,
                untried=state.untried if state.cut else None,
                host_peak_bytes=_host_peak(best, host_budget.need(best.rung, job.model, spec, job.placement.kind,
                                                                  fraction=host_fraction, overlap=state.overlap,
                                                                  snapshot=False).total, job.placement.kind))


def _why_no_mfu(flops: FlopCount, peak: DevicePeak, precision: str, device_type: str) -> list[str]:
    """A note for the plan's reason where a GPU plan gets no MFU (the CPU test device has no peak to give one)."""
    if device_type != "cuda":
        return []
    if flops.per_sample is None:
        return [f"no MFU: {flops.why_not}"]
    if not peak.flops(precision):
        return [f"no MFU: no {precision} peak for this GPU ({peak.source})"]
    return []


def _host_peak(best: Trial, arithmetic: int, device_type: str) -> int:
    """The host bytes the plan adds: where it offloads to a GPU's host, the larger of what its buffers need and
    how far its trial raised the process's resident memory (measured). Elsewhere the arithmetic alone: with
    nothing offloaded a trial's rise is CUDA's own start-up, and on the CPU the simulated device's memory is
    host memory too, which the rise would count."""
    offloads = best.rung.offload != "none"
    return max(arithmetic, best.host_peak_bytes) if device_type == "cuda" and offloads else arithmetic


def _search_or_fp32(job: Job, ground: Ground, spec: OptimizerSpec, limit: int, snapshot_in_ram: bool,
                    failures: Failures) -> tuple[Ledger, _Setup, Workload, FlopCount, str] | BaseException:
    """`_search`, and where it found nothing in 16 bits because configurations failed for a reason other than
    memory (a kernel this device lacks in bf16, a loss that overflows), the same in fp32, with a note for the
    plan's reason. Where nothing is found, the exception `fit` raises (`Failures.error_for`), returned to be
    raised once the model is put back."""
    try:
        return (*_search(job, ground, spec, limit, snapshot_in_ram, failures), "")
    except NoFeasiblePlan as exc:
        nothing = exc
    # A sharded copy keeps the dtype it was sharded with (`trials_on`): it searches in one precision.
    note = (failures.fp32_instead(nothing.trials) if "bf16" in job.allowed and not is_sharded(ground.model)
            else None)
    if note is not None:
        fp32 = dataclasses.replace(job, allowed=job.allowed - {"bf16"})
        try:
            return (*_search(fp32, ground, spec, limit, snapshot_in_ram, failures, earlier=nothing.trials), note)
        except NoFeasiblePlan as exc:
            nothing = exc
    return failures.error_for(nothing)


def _search(job: Job, ground: Ground, spec: OptimizerSpec, limit: int, snapshot_in_ram: bool,
            failures: Failures | None = None,
            earlier: tuple[Trial, ...] = ()) -> tuple[Ledger, _Setup, Workload, FlopCount]:
    """The controller's steps on the model `ground` holds, the steps after the pick included; the ledger they
    leave, with what the search started from and the workload. `failures` collects the trials that failed for
    a reason other than memory; `earlier` are trials of a search before this one, kept in the record (and in
    the trial budget)."""
    tuned = ground.model
    kept_rung.release()  # an earlier search's trials left the model as they found it: the set-up runs it
    job.deadline.begin_search()
    # Trials backpropagate into their own leaves, never into the user's inputs (a tensor with
    # requires_grad=True keeps its .grad); a loss that differentiates by its inputs still can.
    example = batches.detached(batches.to_device(job.batch, job.placement.torch_device))
    loss = resolve_loss(job.loss_fn, tuned, chunked="chunked_loss" in job.allowed)
    with job.laps.phase("search set-up"):  # the blocks' profile (a forward), the anchors, the FLOP count
        setup = _setup(job, tuned, spec, limit, example, loss)
        host = host_limit(job.settings)  # read once: the default follows the machine's free memory
        rungs, host_notes, host_shares = host_budget.keep_within(setup.rungs, tuned, spec, job.placement.kind, host,
                                                                 snapshot=snapshot_in_ram)
    work = Workload(model=tuned, batch=example, loss_fn=loss, spec=spec, placement=job.placement,
                    budget_bytes=job.budget, limit_bytes=limit, per_rank=job.per_rank, world_size=job.world,
                    blocks=setup.blocks, warmup_steps=job.settings.warmup_steps,
                    measured_steps=job.settings.measured_steps, host_limit_bytes=host,
                    snapshot_in_ram=snapshot_in_ram, reset=ground.reset)
    with job.laps.phase("search set-up"):
        flops = count_flops(tuned, work.batch, work.loss_fn, job.placement)
    runner = host_budget.at_shares(TrialRunner(work, agree=distributed.agree_trial, failures=failures), host_shares)
    longer = lambda rung, micro: runner(rung, micro, measured_steps=2 * work.measured_steps)  # noqa: E731
    if job.progress is not None:
        pinned = host_budget.pinned_bytes(tuned, spec, job.placement.kind, host_shares)
        runner, longer = job.progress.watch(runner, host_bytes=pinned), job.progress.watch(longer, "re-measure")
    runner, longer = job.deadline.guard(runner), job.deadline.guard(longer)  # no trial starts past the bound
    controller = Controller(runner, per_rank=job.per_rank, limit_bytes=limit, max_micro=job.bound,
                            max_trials=job.settings.max_trials, world_size=job.world, remeasure=longer,
                            retry=longer if job.placement.simulated else None,  # search/noise.py
                            advice=RUN_ADVICE if result_file() is not None else FIT_ADVICE)
    controller.notes.extend(setup.dropped + host_notes)  # in the plan's reason, and in the error if nothing fits
    controller.trials.extend(earlier)
    if job.progress is not None:
        job.progress.planned = controller.trials_planned  # for the estimate of the time left
    state = controller.search(rungs, setup.lattice, AfterPick(run=runner, work=work, sharded=is_sharded(tuned),
                                                              allowed=job.allowed, host_shares=host_shares))
    kept_rung.release()  # what follows the search runs the model as fit found it
    return state, setup, work, flops


def _at_typical_length(job: Job, state: Ledger, work: Workload) -> typical.TypicalRate | None:
    """Where `fit` lengthened the example to max_length: the pick's figures at the example's own length (its
    note goes to the plan's reason); None otherwise, or where that trial did not run clean."""
    if job.typical is None:
        return None
    progress = job.progress

    def watch(runner: typical.Runner, what: str) -> typical.Runner:
        return job.deadline.guard(progress.watch(runner, what) if progress is not None else runner)

    try:
        rate, note = typical.measure(state, work, job.typical, watch)
    except OutOfTime:
        state.cut = True
        rate, note = None, ("rate at the example's length not measured (max_tune_seconds passed): the figures are "
                            "at max_length")
    state.found("typical length", note)  # where the plan's figures come from: said whatever else is
    return rate


def _setup(job: Job, tuned: nn.Module, spec: OptimizerSpec, limit: int, example: Any, loss: Any) -> _Setup:
    """The anchors the search climbs, the lattice it places beyond them, and the notes on what was left out."""
    allowed, placement = job.allowed, job.placement
    # Which blocks, and in which order, by the activations they hold: one forward, so in the snapshot.
    # Not under FSDP2 (the profile reads parameter storages, which shards wrap): structural order there.
    profiled = "checkpointing" in allowed and not is_sharded(tuned)
    blocks = (profile_blocks(tuned, example, loss, placement) if profiled
              else find_blocks(tuned))  # sharding's units; and the model's own checkpointing, reported
    rungs, notes = anchors(allowed, placement, blocks, float64=is_float64(tuned))
    notes += _loss_notes(job.loss_fn, loss, tuned, allowed) + fused_note(spec, tuned, placement.torch_device.type)
    notes += allocator.note() if not placement.simulated else []
    if batches.tokens_per_sample(example) is not None:  # (a model of token batches, the kind that attends)
        notes += attention_lengths.note(placement.torch_device.type)
    rungs, more = eight_bit_anchors(rungs, allowed, spec, placement.kind)
    notes += more
    rungs, more = fp8_anchors(rungs, allowed, placement, tuned)
    notes = more + notes  # fp8 is asked for by name: what became of it is said first (the reason keeps two notes)
    rungs, dtype_notes = serve_dtypes(rungs, job.model)  # a rung that cannot train the model's dtypes is never tried
    floors = [resident_floor(r, tuned, state_tensors_per_parameter(spec)) for r in rungs]
    compile_notes: list[str] = []
    lattice = Lattice(blocks=len(blocks.blocks) if blocks is not None else 0,
                      shares=blocks.shares() if blocks is not None else None,
                      compile=_compile_allowed(allowed, placement, compile_notes),
                      floors=dict(zip(rungs, floors)))
    scratch = step_scratch(spec, tuned, placement.torch_device.type)  # and the optimizer step's temporaries
    at_step = [resident_floor(r, tuned, state_tensors_per_parameter(spec), scratch=scratch) for r in rungs]
    rungs, dropped = drop_rungs_over(rungs, at_step, limit)  # floors count what this rank holds: its shard
    return _Setup(rungs=rungs, lattice=lattice, blocks=blocks, notes=dtype_notes + notes, dropped=dropped,
                  compile_notes=compile_notes)


def verify(plan: Plan, job: Job) -> Trial:
    """One trial of `plan`'s configuration at its micro-batch, on the model as training will run it (an FSDP2
    plan on a sharded copy), leaving the model, optimizer and RNG as they were (as `tune` does); two where the
    plan overlaps optimizer offload and accumulates, its rate that of training's step (`as_trained`)."""
    model, placement = job.model, job.placement
    conflict = dtype_conflict(plan.rung, model)
    if conflict is not None:  # such a rung crashes in its first step: the search never tries it either
        return Trial(rung=plan.rung, micro_batch_size=plan.micro_batch_size, outcome="error", note=conflict)
    spec = OptimizerSpec.from_user(job.optimizer, model)
    copied = plan.sharding in FSDP and not is_sharded(model)
    with trials_on(model, job.optimizer, placement, copied=copied, precision=plan.precision,
                   snapshot_to_disk=snapshot_on_disk(model),
                   nodes=plan.config.nodes if plan.sharding == "hsdp" else 1) as ground:
        tuned = ground.model
        example = batches.detached(batches.to_device(job.batch, placement.torch_device))
        loss = resolve_loss(job.loss_fn, tuned, chunked="chunked_loss" in job.allowed)
        work = Workload(model=tuned, batch=example, loss_fn=loss, spec=spec, placement=placement,
                        budget_bytes=plan.memory_budget_bytes,
                        limit_bytes=int((1 - plan.margin) * plan.memory_budget_bytes), per_rank=job.per_rank,
                        world_size=job.world, blocks=find_blocks(tuned, plan.block_paths),
                        warmup_steps=job.settings.warmup_steps, measured_steps=job.settings.measured_steps)
        run = TrialRunner(work, agree=distributed.agree_trial)
        trial = as_trained(lambda overlap: run(plan.rung, plan.micro_batch_size, offload_fraction=host_share(plan),
                                               overlap=overlap, sharding=plan.sharding),
                           plan.offload_overlap is True, plan.micro_batch_size, job.per_rank)
        del tuned, work, loss
    return trial


def _loss_notes(loss_fn: Any, loss: Any, model: nn.Module, allowed: frozenset[str]) -> list[str]:
    """Why the model's own loss is (or is not) computed a chunk of tokens at a time."""
    if loss_fn is not None or "chunked_loss" not in allowed:
        return []
    if loss is chunked_default_loss:
        return ["chunked_loss: the LM head's logits and loss a chunk of tokens at a time (no full logits held)"]
    why = chunked_loss.why_not(model)
    hf = getattr(chunked_loss.unwrapped(model), "lm_head", None) is not None
    return [f"chunked_loss skipped: {why}"] if hf and why else []


def _compile_allowed(allowed: frozenset[str], placement: Placement, notes: list[str]) -> bool:
    """Whether the search may try compile; when it may not although allowed, a note says why."""
    if "compile" not in allowed:
        return False
    why = compile_unavailable(placement)
    if why is not None:
        notes.append(why)
    return why is None
