"""Several GPUs: replicated scaling, a sharded plan chosen by `fit`, and every rung on FSDP2 shards.

Run under torchrun, one process per GPU (`bench_multi_gpu.sh` runs the three cases and the one-GPU baseline):

    python benchmarks/bench_multi_gpu.py --case replicated --model gpt2-medium --budget 16GiB      # 1 GPU
    torchrun --nproc-per-node 2 benchmarks/bench_multi_gpu.py --case replicated --model gpt2-medium --budget 16GiB
    torchrun --nproc-per-node 2 benchmarks/bench_multi_gpu.py --case needs-sharding --model gpt2-xl --budget 16GiB
    torchrun --nproc-per-node 2 benchmarks/bench_multi_gpu.py --case presharded --model gpt2-large --budget 10GiB
    torchrun --nproc-per-node 2 benchmarks/bench_multi_gpu.py --case presharded --model tiny-gpt --device cpu \
        --budget 12MiB --seq 32 --global-batch-size 8          # a CPU dry run (gloo)

Cases:
    replicated      `fit` then `--steps` training steps with `plan.apply` on the model as given; tokens/s of the
                    whole global batch. Beside the one-GPU run at the same per-GPU budget this is the scaling.
    needs-sharding  the model handed to `fit` unsharded; its replicated floor is over the limit, so the plan must
                    say sharding="fsdp2" and `plan.apply` shards it; then `--steps` steps.
    presharded      `shard(model)` before `fit`; then every rung of the ladder at micro-batch 1 for a few steps
                    with its peak beside the arithmetic (this rank's shard of weights, gradients, AdamW state);
                    AdamW in the `--optimizer-form` asked, and with `--breakdown phases` (CUDA) each rung's
                    peak by phase of the step, or with `--breakdown trace` by what allocated it
                    (`peak_breakdown.py`).

Every rank runs the same thing; rank 0 prints a JSON line per result (and appends it to `--out`). Each GPU is
capped at `--budget` with `torch.cuda.set_per_process_memory_fraction`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import os
import statistics
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peak_breakdown import PhasePeaks, Recorder
from workloads import build_gpt, cap_memory

import autotune
from autotune import parallel
from autotune.devices.placement import resolve_device
from autotune.errors import is_oom
from autotune.parallel import reduce as distributed
from autotune.plan import Plan
from autotune.sizes import parse_bytes
from autotune.techniques import TECHNIQUES, find_blocks, ladder
from autotune.techniques.sharding import is_sharded, shard
from autotune.workload.batching import solve_accumulation


def main() -> None:
    args = _parse()
    world, rank = _init(args.device)
    if rank == 0:  # fit's progress, one line per trial (AUTOTUNE_PROGRESS=lines), so a crash shows where it was
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        os.environ.setdefault("AUTOTUNE_PROGRESS", "lines")
    device = f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else "cpu"
    cap_memory(device, args.budget)
    if args.bucket_mb:
        distributed.BUCKET_BYTES = int(args.bucket_mb * 2**20)
    try:
        result = {"replicated": run_replicated, "needs-sharding": run_replicated, "presharded": run_presharded,
                  "link": run_link}[args.case](args, device, world, rank)
    except Exception as exc:  # noqa: BLE001 - a failed case is a result too, with its traceback
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    result = {"case": args.case, "model": args.model, "world_size": world, "budget": args.budget,
              "bucket_bytes": distributed.BUCKET_BYTES,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", **result}
    if rank == 0:
        line = json.dumps(result)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()


def run_replicated(args: argparse.Namespace, device: str, world: int, rank: int) -> dict[str, Any]:
    """`fit` on the model as given, then training steps; for needs-sharding the plan must shard it."""
    model, example = build_gpt(args.model, device, args.seq)
    started = time.perf_counter()
    plan = autotune.fit(model, example, global_batch_size=args.global_batch_size, memory_budget=args.budget,
                        device=args.device, cache=False)
    tune_s = time.perf_counter() - started
    differ = _differs_between_ranks({**plan.config.to_dict(), **plan.evidence.to_dict()})
    # The decisions must agree; a trial's note (each rank's own words on its timings) and the seconds each rank
    # spent outside trials may differ.
    agreed = not [k for k in differ if k not in ("trials", "reason", "tune_seconds", "tune_phases")]
    out = {"plan": plan.summary(), "sharding": plan.sharding, "reduce_overlap": plan.reduce_overlap,
           "reason": plan.reason, "tune_seconds": tune_s,
           "estimate_tokens_per_second": plan.tokens_per_second,
           "plan_reduce_seconds": max((t.reduce_seconds for t in plan.trials if t.rung == plan.rung
                                       and t.micro_batch_size == plan.micro_batch_size), default=0.0),
           "trials": len(plan.trials), "ooms": sum(t.outcome == "oom" for t in plan.trials), "ranks_agree": agreed,
           "ranks_differ_in": differ}
    if args.case == "needs-sharding" and plan.sharding != "fsdp2":
        return {**out, "error": "the plan did not shard a model whose replicated floor is over the limit"}
    step = plan.apply(model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    out.update(_train(step, args, device, rank, world))
    out["sharded_after_apply"] = is_sharded(model)
    if args.compare_reduce and plan.sharding != "fsdp2" and world > 1:  # replicated ranks all-reduce
        # The same plan and process with the all-reduce the other way from fit's choice (plan.reduce_overlap):
        # in one bucket after backward where fit kept the buckets, in buckets where it chose one. Beside the
        # steps above, what fit's choice gained or lost.
        other = plan.reduce_overlap is False
        step.plan = step.plan.with_config(reduce_overlap=other)
        out["reduce_other_way"] = {"reduce_overlap": other, **_train(step, args, device, rank, world)}
    started = time.perf_counter()
    step.close()  # partitioned offload: gathers the FP32 weights and the optimizer state from every rank
    out["close_seconds"] = time.perf_counter() - started
    # Replicated ranks must hold the same weights; FSDP2 ranks hold different shards by design (None there).
    out["weights_agree_after_close"] = None if is_sharded(model) else not _differs_between_ranks(
        {"sum": sum(float(p.detach().double().sum()) for p in model.parameters())})
    out["offload_partition"] = os.environ.get("AUTOTUNE_OFFLOAD_PARTITION", "1")
    if args.shares:
        out["shares"] = [_train_share(model, plan, share, args, device, rank, world) for share in args.shares]
    if args.trials:
        out["trials_vs_trained"] = [_trial_and_train(model, example, plan, variant, args, device, rank, world)
                                    for variant in args.trials]
    return out


def _trial_and_train(model: torch.nn.Module, example: Any, plan: Any, variant: str, args: Args, device: str,
                     rank: int, world: int) -> dict[str, Any]:
    """What the search's trial runner says of a variant (`--shares` form), with the default measured steps and
    with 4 times as many, then the variant trained for `--steps` in the same process: how well a trial predicts
    training for it."""
    from autotune.search.trial import TrialRunner, Workload
    from autotune.workload.losses import resolve
    from autotune.workload.optimizers import OptimizerSpec

    other = variant_plan(plan, variant)
    budget = parse_bytes(args.budget)
    work = Workload(model=model, batch=example, loss_fn=resolve(None, model, chunked=True),
                    spec=OptimizerSpec.from_user(None, model), placement=resolve_device(args.device),
                    budget_bytes=budget, limit_bytes=int(0.9 * budget), per_rank=args.global_batch_size // world,
                    world_size=world, blocks=find_blocks(model))
    runner = TrialRunner(work, agree=parallel.agree_trial)
    fraction = other.offload_fraction if other.offload == "optimizer" else 1.0
    out: dict[str, Any] = {"variant": variant}
    for steps in (work.measured_steps, 4 * work.measured_steps):
        t = runner(other.rung, other.micro_batch_size, measured_steps=steps, offload_fraction=fraction,
                   sharding=other.sharding)
        out[f"trial_{steps}"] = {"outcome": t.outcome, "tokens_per_second": t.samples_per_second * args.seq,
                                 "step_seconds": t.step_seconds, "optimizer_seconds": t.optimizer_seconds,
                                 "reduce_seconds": t.reduce_seconds, "peak_gib": t.peak_bytes / 2**30}
    out["trained"] = _train_share(model, plan, variant, args, device, rank, world)
    return out


def _train_share(model: torch.nn.Module, plan: Any, variant: str, args: Args, device: str, rank: int,
                 world: int) -> dict[str, Any]:
    """The plan with another host share (`plan.offload_fraction`), trained in the same process after it: what
    the search's share left on the table, or what a smaller one would cost in memory (a share that does not
    fit shows as a recovery and a peak over the limit). `variant` is SHARE[@MICRO][@one|@buckets][@kBLOCKS]: another
    micro-batch too, one gradient bucket (the all-reduce after backward), BLOCKS repeated blocks recomputed
    (compile as the plan has it); SHARE 0 is no optimizer offload, z optimizer offload with nothing on the host
    (the state partitioned over the ranks)."""
    other = variant_plan(plan, variant)
    micro, share = other.micro_batch_size, other.offload_fraction
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    step = other.apply(model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    try:
        out = {"variant": variant, "offload_fraction": float(share), "micro_batch_size": micro,
               **_train(step, args, device, rank, world)}
    except Exception as exc:  # noqa: BLE001 - a share that fails is a result too
        out = {"variant": variant, "offload_fraction": float(share), "error": f"{type(exc).__name__}: {exc}"}
    step.close()
    if device.startswith("cuda"):
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def variant_plan(plan: Any, variant: str) -> Any:
    """`plan` as SHARE[@MICRO][@one|@buckets][@kBLOCKS] changes it (see `_train_share`): `one` sets
    `plan.reduce_overlap` False (one gradient bucket, after backward), `buckets` True; else fit's choice stays."""
    share, *rest = variant.split("@")
    partitioned = share == "z"  # sharding "optimizer_state": nothing on the host, the state partitioned over the ranks
    share = "0" if partitioned else share
    micros = [int(r) for r in rest if r.isdigit()]
    blocks = [int(r[1:]) for r in rest if r.startswith("k") and r[1:].isdigit()]
    micro = micros[0] if micros else plan.micro_batch_size
    steps, last = solve_accumulation(plan.per_rank_batch_size, micro)
    k = blocks[0] if blocks else plan.checkpointed_blocks
    n = len(plan.block_paths) or 10**9
    sharding = "optimizer_state" if partitioned else "none" if plan.partitioned_state else plan.sharding
    other = plan.with_config(offload_fraction=None if partitioned else float(share), micro_batch_size=micro,
                             offload="optimizer" if float(share) > 0 else "none", sharding=sharding,
                             checkpointed_blocks=k,
                                checkpointing="none" if not k else "full" if k >= n else "selective",
                                accumulation_steps=steps, last_micro_batch_size=last)
    if "one" in rest or "buckets" in rest:
        other = other.with_config(reduce_overlap="buckets" in rest)
    return other


def run_presharded(args: argparse.Namespace, device: str, world: int, rank: int) -> dict[str, Any]:
    """`shard` before `fit`; then every rung of the ladder on the shards, each with its peak."""
    model, example = build_gpt(args.model, device, args.seq)
    params = sum(p.numel() for p in model.parameters())
    blocks = find_blocks(model)
    block = sum(p.numel() for p in blocks.blocks[0].parameters()) if blocks is not None else 0
    root = params - block * (len(blocks.blocks) if blocks is not None else 0)
    shard(model)
    started = time.perf_counter()
    try:
        plan = autotune.fit(model, example, global_batch_size=args.global_batch_size, memory_budget=args.budget,
                            device=args.device, cache=False)
        fitted: dict[str, Any] = {"plan": plan.summary(), "reason": plan.reason, "trials": [
            [t.rung.name, t.micro_batch_size, t.outcome, t.peak_bytes] for t in plan.trials]}
    except autotune.NoFeasiblePlan as exc:
        fitted = {"plan": None, "no_feasible_plan": str(exc)[:2000]}
    fitted["tune_seconds"] = time.perf_counter() - started
    rungs, _ = ladder(frozenset(TECHNIQUES) - {"compile"}, resolve_device(device), find_blocks(model))
    rungs = [r for r in rungs if not args.rungs or r.name in args.rungs]
    each = [_one_rung(model, rung, args, device, world, rank) for rung in rungs]
    # What a rank holds before any activation: its shard of FP32 weights, gradients and two AdamW moments.
    # Beside it, while a unit (a block, or the root with the embeddings) runs: its BF16 all-gather (twice with
    # FSDP's prefetch of the next), its unsharded BF16 gradient and the FP32 copy reduce-scattered.
    arithmetic = 16 * params / world
    transient = (2 * 2 + 2 + 4) * max(block, root)
    return {**fitted, "parameters": params, "block_parameters": block, "root_parameters": root,
            "arithmetic_floor_bytes": arithmetic, "arithmetic_transient_bytes": transient, "rungs": each}


def _one_rung(model: torch.nn.Module, rung: Any, args: argparse.Namespace, device: str, world: int,
              rank: int) -> dict[str, Any]:
    """A few steps of `rung` at micro-batch 1 on the sharded model: ok with its peak, or oom; never an error."""
    per_rank = args.global_batch_size // world
    steps, last = solve_accumulation(per_rank, 1)
    plan = Plan.of(precision=rung.precision, checkpointing=rung.checkpointing, offload=rung.offload,
                checkpointed_blocks=rung.checkpointed_blocks, micro_batch_size=1, accumulation_steps=steps,
                world_size=world, global_batch_size=args.global_batch_size, last_micro_batch_size=last,
                peak_memory_bytes=0, memory_budget_bytes=parse_bytes(args.budget), margin=0.1,
                samples_per_second=0.0, device=args.device, sharding="fsdp2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, **OPTIMIZER_FORMS[args.optimizer_form])
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    recorder: Any = contextlib.nullcontext()
    if args.breakdown == "trace" and args.device == "cuda":
        recorder = Recorder()
    elif args.breakdown == "phases" and args.device == "cuda":
        recorder = PhasePeaks(model, optimizer)
    try:
        with recorder, plan.apply(model, optimizer) as step:
            step.rungs = [rung]  # recovery may not climb: each rung is measured as itself (an OOM at 1 raises)
            timing = _train(step, dataclasses.replace(args, steps=args.rung_steps), device, rank, world)
        outcome = "oom" if step.recoveries else "ok"
        if isinstance(recorder, (Recorder, PhasePeaks)):
            timing["breakdown"] = recorder.breakdown
    except Exception as exc:  # noqa: BLE001 - an OOM is a measurement; anything else is reported as an error
        if not is_oom(exc) and not isinstance(exc, autotune.NoFeasiblePlan):
            return {"rung": rung.name, "outcome": "error", "error": f"{type(exc).__name__}: {exc}"[:1000],
                    "traceback": traceback.format_exc()[-2000:]}
        outcome, timing = "oom", {}
    if args.device == "cuda":
        peak = {"max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved()}
    else:
        peak = {"simulated_peak": step.last_peak_bytes}
    return {"rung": rung.name, "outcome": outcome, **peak, **timing}


def run_link(args: argparse.Namespace, device: str, world: int, rank: int) -> dict[str, Any]:
    """What one step's gradient all-reduce costs on this host, not overlapped: the model's gradients in FP32
    (replicated bf16 autocast) and in BF16 (under optimizer offload), reduced as training does
    (`OverlappedReduce`'s buckets, one all-reduce per parameter), and as one flat tensor of the same bytes."""
    model, _ = build_gpt(args.model, device, args.seq)
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    out: dict[str, Any] = {"parameters": numel, "tensors": len(params)}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        grads = [torch.ones(p.shape, dtype=dtype, device=p.device) for p in params[::-1]]  # backward's order
        flat = torch.ones(numel, dtype=dtype, device=device)
        buckets = distributed._buckets(grads, distributed.BUCKET_BYTES)

        def bucketed() -> None:
            # Called only within this iteration, before the `del` below frees the tensors (binding them as
            # defaults would keep them alive past it).
            works = [dist.all_reduce(g, async_op=True) for b in buckets for g in b]  # noqa: B023, F821
            for w in works:
                w.wait()

        flat_reduce = lambda: dist.all_reduce(flat)  # noqa: B023, E731, F821 - as `bucketed`: used before the `del`
        for label, run in ((f"{name}_per_parameter", bucketed), (f"{name}_flat", flat_reduce)):
            times = []
            for _ in range(6):
                _sync(device)
                t0 = time.perf_counter()
                run()
                _sync(device)
                times.append(time.perf_counter() - t0)
            seconds = statistics.median(times[1:])
            bus_bytes = 2 * (world - 1) / world * numel * flat.element_size()
            out[label] = {"seconds": seconds, "bus_gb_s": bus_bytes / seconds / 1e9}
        del flat, grads, buckets
    return out


def _train(step: Any, args: argparse.Namespace, device: str, rank: int, world: int) -> dict[str, Any]:
    """`args.steps` optimizer steps over random token batches of this rank's share; tokens/s of the global batch."""
    per_rank = args.global_batch_size // world
    g = torch.Generator().manual_seed(1000 + rank)
    times, losses = [], []
    retries = _alloc_retries(device)
    with _GcPauses() as pauses:
        for _ in range(args.steps):
            ids = torch.randint(0, 50257 if args.model.startswith("gpt2") else 128, (per_rank, args.seq), generator=g)
            batch = {"input_ids": ids.to(device), "labels": ids.to(device)}
            _sync(device)
            t0 = time.perf_counter()
            losses.append(step(batch))
            _sync(device)
            times.append(time.perf_counter() - t0)
    measured = times[1:] or times  # the first step builds the optimizer state
    seconds = statistics.median(measured)
    return {"steps": args.steps, "step_seconds": seconds,
            "tokens_per_second": args.global_batch_size * args.seq / seconds,
            "mean_tokens_per_second": args.global_batch_size * args.seq / statistics.mean(measured),
            "last_loss": losses[-1], "recoveries": len(step.recoveries), "final_plan": step.plan.summary(),
            "alloc_retries": _alloc_retries(device) - retries, "step_times": times, "gc_pauses": pauses.by_generation}


class _GcPauses:
    """Python's garbage collections on this rank while the block runs: {generation: [count, seconds]}."""

    def __init__(self) -> None:
        self.by_generation: dict[str, list[float]] = {}
        self._started = 0.0

    def __enter__(self) -> _GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        counted = self.by_generation.setdefault(str(info["generation"]), [0, 0.0])
        counted[0] += 1
        counted[1] += time.perf_counter() - self._started


def _alloc_retries(device: str) -> int:
    """The caching allocator's retries so far (it freed its cache and tried again: a device synchronize each)."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if device.startswith("cuda") else 0


def _differs_between_ranks(obj: dict[str, Any]) -> list[str]:
    """The keys of `obj` whose values are not the same on every rank."""
    if not dist.is_initialized():
        return []
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return sorted(k for k in obj if any(json.dumps(o.get(k), sort_keys=True) != json.dumps(obj[k], sort_keys=True)
                                        for o in everyone))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _init(device: str) -> tuple[int, int]:
    if "RANK" not in os.environ:
        if device == "cuda":
            torch.cuda.set_device(0)
        return 1, 0
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return dist.get_world_size(), dist.get_rank()


@dataclasses.dataclass
class Args:
    case: str
    model: str
    budget: str
    device: str
    seq: int
    global_batch_size: int
    steps: int
    rung_steps: int
    out: str
    bucket_mb: float
    compare_reduce: bool = False
    shares: tuple[str, ...] = ()
    trials: tuple[str, ...] = ()
    optimizer_form: str = "default"
    breakdown: str = ""
    rungs: tuple[str, ...] = ()


# AdamW's implementations: left unset (autotune steps it fused on shards), foreach (torch's default on CUDA),
# the fused kernel, the per-tensor loop
OPTIMIZER_FORMS: dict[str, dict[str, bool]] = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True},
                                               "loop": {"foreach": False}}


def _parse() -> Args:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=("replicated", "needs-sharding", "presharded", "link"), required=True)
    p.add_argument("--model", default="gpt2-medium", help="gpt2, gpt2-medium, gpt2-large, gpt2-xl, tiny-gpt")
    p.add_argument("--budget", default="16GiB", help="memory ceiling per GPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="training steps after fit")
    p.add_argument("--rung-steps", type=int, default=3, help="presharded: steps per rung")
    p.add_argument("--optimizer-form", choices=sorted(OPTIMIZER_FORMS), default="default",
                   help="presharded: AdamW's implementation (default: left unset, which autotune steps fused on "
                   "shards; foreach is torch's default on CUDA)")
    p.add_argument("--rungs", default="", help="presharded: only these rungs, comma-separated names as the "
                   "plan prints them (e.g. 'bf16+full ckpt'); default every rung")
    p.add_argument("--breakdown", choices=("phases", "trace"), default=None,
                   help="presharded, CUDA: each rung's peak by phase of the step (forward, backward, optimizer "
                   "step), or by what allocated it from the allocator's trace (peak_breakdown.py)")
    p.add_argument("--bucket-mb", type=float, default=0, help="replicated: gradient bucket size (default DDP's 25); "
                   "a size above the model's gradients starts the all-reduce only when backward ends: no overlap")
    p.add_argument("--compare-reduce", action="store_true",
                   help="replicated: train the plan again with the gradient all-reduce the other way from fit's "
                   "choice (plan.reduce_overlap: in buckets during backward, or in one after it), same process")
    p.add_argument("--shares", default="", help="replicated, under optimizer offload: after the plan, train it again "
                   "with each of these host shares, comma-separated: SHARE[@MICRO][@one|@buckets][@kBLOCKS] "
                   "(another micro-batch; one gradient bucket after backward, or buckets during it; blocks "
                   "recomputed), e.g. 0.3,0.01@5,1@7@one,0@8@k12 (0: no offload; z: optimizer offload with "
                   "nothing on the host, the state partitioned over the ranks); same process")
    p.add_argument("--trials", default="", help="replicated: after the plan, each of these variants (the --shares "
                   "form) through the search's trial runner (default and 4x measured steps), then trained; "
                   "same process")
    p.add_argument("--out", default="", help="append the JSON lines here")
    a = p.parse_args()
    return Args(case=a.case, model=a.model, budget=a.budget, device=a.device, seq=a.seq,
                global_batch_size=a.global_batch_size, steps=a.steps, rung_steps=a.rung_steps, out=a.out,
                bucket_mb=a.bucket_mb, compare_reduce=a.compare_reduce,
                shares=tuple(x.strip() for x in a.shares.split(",") if x.strip()),
                trials=tuple(x.strip() for x in a.trials.split(",") if x.strip()),
                optimizer_form=a.optimizer_form, breakdown=a.breakdown or "",
                rungs=tuple(x.strip() for x in a.rungs.split(",") if x.strip()))


if __name__ == "__main__":
    main()
