"""What the benchmarks train, and the measurements every method shares.

A `Spec` names one workload: the model, the memory ceiling, the global batch. `build` makes its model
(random weights) and an example batch on the device; `cap_memory` sets the ceiling; `trial_runner`
wraps autotune's own `TrialRunner` (the one measuring stick: every method's answer, and every point of
the grid, is timed with it); `grid` is the exhaustive search; `train_steps` is the plain training loop
(BF16 autocast through the rung, exact accumulation, no OOM recovery) that checks an answer holds for
many steps. bench_fit.py and bench_peers.py both import from here.

Workloads:
    W1  GPT-2 large (774M), seq 1024, AdamW, global batch 64, 24 GiB ceiling
    W2  GPT-2 XL (1.5B), seq 1024, AdamW, global batch 64, 16 GiB ceiling: FP32 weights, gradients and
        Adam state alone are 1.5B x 16 B = 24 GB, so only an optimizer-offload plan can run
    W3  ResNet-152 (BatchNorm), images 224, global batch 256, 12 GiB ceiling
`--smoke` swaps in tiny stand-ins on the CPU under autotune's simulated ceiling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "examples"))
sys.path.insert(0, os.path.join(_HERE, ".."))

from autotune.configuration import Rung  # noqa: E402
from autotune.devices.ceiling import SimulatedCeiling  # noqa: E402
from autotune.devices.placement import Placement, now, resolve_device  # noqa: E402
from autotune.errors import DeviceError, is_oom  # noqa: E402
from autotune.plan import Trial  # noqa: E402
from autotune.search.trial import TrialRunner, Workload  # noqa: E402
from autotune.sizes import parse_bytes  # noqa: E402
from autotune.techniques import apply_rung, find_blocks, ladder, parse_techniques  # noqa: E402
from autotune.workload import batch as batches  # noqa: E402
from autotune.workload.batching import split_sizes  # noqa: E402
from autotune.workload.losses import default_loss  # noqa: E402
from autotune.workload.optimizers import OptimizerSpec  # noqa: E402

GRID_MICRO = (1, 2, 4, 8, 16, 32, 64)
EXAMPLE_ROWS = 8  # rows in the example batch; trials repeat them cyclically up to any micro-batch
# layers, width, heads
GPT2_SIZES = {"gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20),
              "gpt2-xl": (48, 1600, 25)}


@dataclass(frozen=True, kw_only=True, slots=True)
class Spec:
    """One benchmark workload."""

    name: str  # "W1"
    title: str  # "GPT-2 large, seq 1024"
    model: str  # a key of `build`: "gpt2-large", "gpt2-xl", "resnet152", "tiny-gpt", "tiny-cnn"
    budget: str  # the memory ceiling, e.g. "24GiB"
    global_batch_size: int
    seq: int = 0  # tokens per sample for language models; 0 for images
    image: int = 0  # image side for vision models
    device: str = "cuda"
    grid_micro: tuple[int, ...] = GRID_MICRO
    trial_steps: int = 3  # measured steps per trial (after one warm-up), for the grid and the answers
    needs: tuple[str, ...] = ()  # importable modules the model needs; the workload is skipped without them

    @property
    def unit(self) -> str:
        return "tok/s" if self.seq else "img/s"

    @property
    def per_sample(self) -> int:
        """Multiplier from samples/s to the unit: tokens per sample, or 1 image."""
        return self.seq or 1

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "model": self.model, "budget": self.budget,
                "global_batch_size": self.global_batch_size, "seq": self.seq, "image": self.image,
                "unit": self.unit, "per_sample": self.per_sample, "trial_steps": self.trial_steps}


WORKLOADS = {
    "W1": Spec(name="W1", title="GPT-2 large (774M), seq 1024, AdamW", model="gpt2-large", budget="24GiB",
               global_batch_size=64, seq=1024, needs=("transformers",)),
    "W2": Spec(name="W2", title="GPT-2 XL (1.5B), seq 1024, AdamW", model="gpt2-xl", budget="16GiB",
               global_batch_size=64, seq=1024, needs=("transformers",)),
    "W3": Spec(name="W3", title="ResNet-152 (BatchNorm), 224x224, AdamW", model="resnet152", budget="12GiB",
               global_batch_size=256, image=224, grid_micro=GRID_MICRO + (128, 256)),
}
# Not one of the peers' workloads: the multi-GPU issue's one-GPU case, for bench_trial_steps.py.
EXTRA = {"M16": Spec(name="M16", title="GPT-2 medium (355M), seq 1024, AdamW", model="gpt2-medium", budget="16GiB",
                     global_batch_size=64, seq=1024, needs=("transformers",))}
# CPU stand-ins: the same roles at toy size, under autotune's simulated ceiling (budgets measured so that
# W1 needs a rung above plain BF16 to grow, W2 runs only with optimizer offload, W3 has BatchNorm).
SMOKE = {
    "W1": Spec(name="W1", title="smoke: tiny GPT (4 layers, width 64), seq 32", model="tiny-gpt", budget="8MiB",
               global_batch_size=16, seq=32, device="cpu", grid_micro=(1, 2, 4, 8, 16), trial_steps=1),
    "W2": Spec(name="W2", title="smoke: tiny GPT (4 layers, width 64), seq 32, offload-only budget",
               model="tiny-gpt", budget="3MiB", global_batch_size=16, seq=32, device="cpu",
               grid_micro=(1, 2, 4, 8, 16), trial_steps=1),
    "W3": Spec(name="W3", title="smoke: tiny BatchNorm CNN, 16x16", model="tiny-cnn", budget="3MiB",
               global_batch_size=32, image=16, device="cpu", grid_micro=(1, 2, 4, 8, 16, 32), trial_steps=1),
}


def workloads(smoke: bool) -> dict[str, Spec]:
    return SMOKE if smoke else WORKLOADS


def missing(spec: Spec) -> list[str]:
    """Modules the workload needs that are not installed (empty: it can run)."""
    if spec.model == "resnet152":
        return [] if _installed("torchvision") or _installed("timm") else ["torchvision or timm"]
    return [m for m in spec.needs if not _installed(m)]


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# -- models -------------------------------------------------------------------------------------------
class ConvBlock(nn.Module):
    """conv-BN-ReLU-conv-BN with a residual: a repeated block, so checkpointing can find it."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                                  nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.body(x))


def tiny_cnn(channels: int = 16, blocks: int = 4, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
                         nn.Sequential(*(ConvBlock(channels) for _ in range(blocks))),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))


def classify_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """(images, labels) -> mean cross-entropy."""
    images, labels = batch[0], batch[1]
    return F.cross_entropy(model(images).float(), labels)


def build(spec: Spec, device: str | None = None) -> tuple[nn.Module, Any, Callable[[nn.Module, Any], Any]]:
    """(model, example batch, loss_fn) on `device`, from seed 0."""
    device = device or spec.device
    torch.manual_seed(0)
    if spec.seq:
        model, batch = build_gpt(spec.model, device, spec.seq)
        return model, batch, default_loss
    with torch.device(device):
        if spec.model == "tiny-cnn":
            model, classes = tiny_cnn(), 10
        else:
            model, classes = _vision(spec.model), 1000
        images = torch.randn(EXAMPLE_ROWS, 3, spec.image, spec.image)
        labels = torch.randint(0, classes, (EXAMPLE_ROWS,))
    return model, (images, labels), classify_loss


def build_gpt(name: str, device: str, seq: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A GPT with random weights and an example batch {input_ids, labels} of `EXAMPLE_ROWS` rows."""
    torch.manual_seed(0)
    if name in ("tiny", "tiny-gpt"):
        from gpt import GPT, GPTConfig, random_batch

        cfg = (GPTConfig(n_layer=6, n_embd=128, seq_len=seq) if name == "tiny"  # bench_fit's tiny model
               else GPTConfig(vocab_size=128, n_layer=4, n_embd=64, n_head=4, seq_len=seq))
        ids, labels = random_batch(cfg, EXAMPLE_ROWS)
        return GPT(cfg).to(device), {"input_ids": ids.to(device), "labels": labels.to(device)}
    from transformers import GPT2Config, GPT2LMHeadModel

    n_layer, n_embd, n_head = GPT2_SIZES[name]
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=max(1024, seq), use_cache=False)
    with torch.device(device):  # initialise on the device: seconds instead of a minute of CPU init for 1.5B
        model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (EXAMPLE_ROWS, seq), device=device)
    return model, {"input_ids": ids, "labels": ids}


def _vision(name: str) -> nn.Module:
    if _installed("torchvision"):
        import torchvision

        return getattr(torchvision.models, name)(weights=None)
    import timm

    return timm.create_model(name, pretrained=False)


# -- the ceiling --------------------------------------------------------------------------------------
def cap_memory(device: str, budget: str | int) -> None:
    """On CUDA, cap this process's allocator at `budget` (the benchmark's memory ceiling)."""
    if device.startswith("cuda"):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_bytes(budget) / total))


class CudaLikeCeiling(SimulatedCeiling):
    """autotune's simulated ceiling, raising the text CUDA raises, so that code which classifies OOMs by
    message (Accelerate wants " out of memory.", Lightning "CUDA" and "out of memory") reacts on the CPU
    as it would on a GPU."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except torch.OutOfMemoryError as exc:
            # A failed cudaMalloc allocates nothing; the simulation has already made the op's output, so
            # free it (it lives in the raising frame) before anyone can hold on to the error.
            traceback.clear_frames(exc.__traceback__)
            text = str(exc)
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate past the ceiling ({text})")


@contextlib.contextmanager
def emulated_ceiling(device: str, budget: str | int, *tracked: Any) -> Iterator[SimulatedCeiling | None]:
    """On the CPU, a `CudaLikeCeiling` of `budget` counting `tracked` (model, batch) from the start; on
    CUDA nothing (the allocator cap from `cap_memory` is the real ceiling)."""
    if not device.startswith("cpu"):
        yield None
        return
    ceiling = CudaLikeCeiling(parse_bytes(budget))
    with ceiling:
        ceiling.track(list(tracked))
        try:
            yield ceiling
        finally:
            ceiling.close()


# -- measuring ----------------------------------------------------------------------------------------
def trial_runner(spec: Spec, model: nn.Module, batch: Any, loss_fn: Any, device: str,
                 measured_steps: int | None = None, margin: float = 0.1) -> tuple[TrialRunner, list[Rung]]:
    """autotune's trial runner over this workload (the measuring stick), and autotune's rungs for it."""
    placement = resolve_device(device)
    budget = parse_bytes(spec.budget)
    blocks = find_blocks(model)
    rungs, _ = ladder(parse_techniques(None), placement, blocks)
    work = Workload(model=model, batch=batch, loss_fn=loss_fn, spec=OptimizerSpec.from_user(None, model),
                    placement=placement, budget_bytes=budget, limit_bytes=int((1 - margin) * budget),
                    per_rank=spec.global_batch_size, blocks=blocks,
                    measured_steps=measured_steps or spec.trial_steps)
    return TrialRunner(work), rungs


@dataclass(kw_only=True, slots=True)
class GridResult:
    trials: list[Trial]
    complete: bool = True  # False when `stop_at` cut it short
    errors: list[dict[str, Any]] = field(default_factory=list)  # non-OOM failures: {rung, micro_batch_size, error}


def grid(runner: TrialRunner, rungs: list[Rung], micro_sizes: tuple[int, ...], per_rank: int,
         on_trial: Callable[[Trial], None] = lambda t: None, stop_at: float | None = None) -> GridResult:
    """Every rung at every micro-batch size up to `per_rank`, smallest first; on each rung, sizes above an
    OOM are skipped (they cannot fit either). A rung that fails otherwise (a bug, not memory) is recorded
    and the grid goes on with the next rung; a poisoned CUDA context (`DeviceError`) ends it."""
    result = GridResult(trials=[])
    for rung in rungs:
        for micro in [m for m in micro_sizes if m <= per_rank]:
            if stop_at is not None and time.time() > stop_at:
                result.complete = False
                return result
            try:
                trial = runner(rung, micro)
            except DeviceError:
                raise
            except Exception as exc:  # noqa: BLE001 - recorded with the rung, which the table then shows
                text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
                print(f"grid {rung.name:36} {micro:4d} error: {text}", flush=True)
                result.errors.append({"rung": rung.name, "micro_batch_size": micro, "error": text})
                break
            result.trials.append(trial)
            on_trial(trial)
            if trial.outcome == "oom":
                break
    return result


def best_trial(trials: list[Trial] | list[dict[str, Any]]) -> Any:
    """The fastest trial that fits within the margin (outcome "ok"), or None."""
    ok = [t for t in trials if (t["outcome"] if isinstance(t, dict) else t.outcome) == "ok"]
    key = (lambda t: t["samples_per_second"]) if ok and isinstance(ok[0], dict) else (lambda t: t.samples_per_second)
    return max(ok, key=key) if ok else None


def config_of(rung: Rung, micro: int, global_batch: int, offload_fraction: float = 1.0) -> dict[str, Any]:
    """A configuration as recorded: every knob of the rung (compile and the block count included: a record
    that kept only precision, checkpointing and offload verified a different configuration from the plan's),
    the host share under optimizer offload, the micro-batch, and the accumulation that keeps the global batch."""
    from autotune.workload.batching import solve_accumulation

    micro = min(micro, global_batch)
    steps, last = solve_accumulation(global_batch, micro)
    return {"rung": dataclasses.asdict(rung), "offload_fraction": offload_fraction, "name": rung.name,
            "micro_batch_size": micro, "accumulation_steps": steps, "last_micro_batch_size": last}


def config_rung(config: dict[str, Any]) -> Rung:
    """The rung of a recorded configuration (records written before every knob was kept get the defaults)."""
    return Rung(**config["rung"])


def config_key(config: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two recorded configurations the same one: the whole rung, the host share, the micro-batch."""
    return (*dataclasses.astuple(config_rung(config)), config.get("offload_fraction", 1.0), config["micro_batch_size"])


def train_steps(spec: Spec, model: nn.Module, batch: Any, loss_fn: Any, device: str, rung: Rung, micro: int,
                steps: int, stop_at: float | None = None, offload_fraction: float = 1.0) -> dict[str, Any]:
    """`steps` optimizer steps over the global batch at (rung, micro): the same plain loop for every method.

    Each step splits the global batch into micro-batches (the last one smaller when it does not divide),
    weights each loss by its share of the samples, steps once and frees the gradients, as autotune's own
    training step does, but an OOM ends the run (no recovery): the question is whether the answer holds.
    On the CPU the simulated ceiling is in force, raising CUDA's OOM text.
    """
    placement = resolve_device(device)
    global_batch = spec.global_batch_size
    sizes = split_sizes(global_batch, min(micro, global_batch))
    times: list[float] = []
    losses: list[float] = []  # the last micro-batch's loss of each step: a NaN shows that a plan trains nothing
    failure, stopped = "", ""
    peak = 0
    if not placement.simulated:
        torch.cuda.reset_peak_memory_stats(placement.index)
    with emulated_ceiling(device, spec.budget, model, batch) as ceiling:
        applied = apply_rung(model, rung, OptimizerSpec.from_user(None, model), placement, find_blocks(model),
                             offload_fraction=offload_fraction)
        try:
            failure, stopped = _loop(applied, model, batch, loss_fn, placement, sizes, global_batch, steps,
                                     stop_at, times, losses)
        finally:
            applied.remove()
            for p in model.parameters():
                p.grad = None
        peak = ceiling.peak_bytes if ceiling is not None else torch.cuda.max_memory_reserved(placement.index)
    steady = times[1:] or times  # the first step builds the optimizer state: time from the second on
    seconds = statistics.median(steady) if steady else 0.0
    return {"steps_requested": steps, "steps_done": len(times), "oom": bool(failure),
            "oom_at_step": len(times) if failure else None,
            "error": failure, "stopped": stopped, "median_step_seconds": seconds,
            "samples_per_second": global_batch / seconds if seconds else 0.0, "peak_bytes": int(peak),
            "micro_batches": sizes, "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None}


def _loop(applied: Any, model: nn.Module, batch: Any, loss_fn: Any, placement: Placement, sizes: list[int],
          global_batch: int, steps: int, stop_at: float | None, times: list[float],
          losses: list[float]) -> tuple[str, str]:
    """Run the steps; (OOM text or "", "time cap" or ""). Tensors of a failed step die with this frame."""
    model.train()
    micro_batches = {n: batches.resize(batch, n) for n in set(sizes)}
    try:
        for _ in range(steps):
            if stop_at is not None and time.time() > stop_at:
                return "", "time cap"
            t0 = now(placement)
            for n in sizes:
                with applied.autocast():
                    loss = loss_fn(model, micro_batches[n])
                applied.backward(loss * (n / global_batch))  # weight by sample share: the full-batch mean
                last = loss.detach()
                del loss
            applied.optimizer_step()
            for p in model.parameters():
                p.grad = None
            times.append(now(placement) - t0)
            losses.append(float(last))  # after the step's timing: the read waits for the device
    except Exception as exc:  # an OOM is the answer failing; anything else propagates
        if not is_oom(exc):
            raise
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}", ""
    return "", ""


# -- facts for the record -----------------------------------------------------------------------------
def environment(device: str, *, name_device: bool = True) -> dict[str, Any]:
    """What ran it: device name, torch and peer versions, date (UTC), host.

    `name_device=False` leaves the name out (""): asking CUDA for it creates a context, hundreds of MiB
    that a parent process would then hold on the GPU while its children measure.
    """
    versions = {}
    for dist in ("transformers", "accelerate", "lightning", "torchvision", "timm"):
        try:
            versions[dist] = metadata.version(dist)  # no import: lightning alone takes seconds to import
        except metadata.PackageNotFoundError:
            pass
    name = "cpu (simulated ceiling)" if not device.startswith("cuda") else (
        torch.cuda.get_device_name(0) if name_device else "")
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "versions": versions,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node()}
