"""Partial optimizer offload: the smallest share of the parameters on the host that still fits.

Full optimizer offload moves every FP32 master and all optimizer state to the host, and the CPU then steps
every parameter. When the chosen micro-batch leaves room under the limit, part of that can stay on the
device and be stepped there (Megatron-Core's `offload_fraction`): less host work, less PCIe traffic. Which
share, by memory arithmetic on the measured peak of full offload, then checked by one trial:

    peak(share kept on the device) ~ peak(full offload) + sum over kept parameters of bytes_to_device(p)

`HostOptimizer` keeps the first parameters in model order on the device (`host_share`), so the arithmetic
walks them in that order and keeps as many as the room allows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from torch import nn

from ..plan import Trial
from ..workload.batching import global_step_seconds

ROOM_USED = 0.85  # share of the measured room the arithmetic may fill: the device optimizer's own step
# temporaries and allocator rounding are not in it, and a trial that runs over costs a second one


def bytes_to_device(p: nn.Parameter, state_tensors: int, *, keep_fp32: bool) -> int:
    """Device bytes a parameter adds when it is stepped on the device instead of the host: its weight and
    gradient widen from 16 to 32 bits (2 + 2 bytes a value; norm weights were FP32 already), autocast keeps
    a 16-bit copy of the FP32 weight through forward (2), its optimizer state (`state_tensors` FP32 tensors
    of its size) comes back, and the device step makes a temporary of its size (AdamW's denominator, 4).
    AdamW: 18 bytes a parameter; 17.7 measured on the CPU test device."""
    widen = 0 if keep_fp32 else 4 + 2
    temporary = 4 if state_tensors else 0
    return p.numel() * (widen + 4 * state_tensors + temporary)


def predict_fraction(params: Sequence[nn.Parameter], room_bytes: float, state_tensors: int,
                     keep_fp32: Collection[nn.Parameter] = (), *, ranks: int = 1) -> float:
    """The host share (0..1, by parameter count) that keeps the most leading parameters on the device
    within `room_bytes`; 1.0 when not even the first fits. The last parameter stays on the host: a plan
    with nothing offloaded is a plan without optimizer offload, which the search measured on its own.

    `ranks` > 1: the device share is partitioned over that many replicated ranks (offload_partition.py),
    each holding the masters and state of 1/ranks of it, so each parameter costs a rank 1/ranks as much."""
    room_bytes *= ranks
    kept = {id(p) for p in keep_fp32}
    total = sum(p.numel() for p in params)
    used = 0
    on_device = 0
    for p in params[:-1]:
        cost = bytes_to_device(p, state_tensors, keep_fp32=id(p) in kept)
        if used + cost > room_bytes:
            break
        used += cost
        on_device += p.numel()
    return 1.0 - on_device / total if total else 1.0


def offload_rival(trials: Sequence[Trial], best: Trial, per_rank: int, noise: float) -> Trial | None:
    """The optimizer-offload trial worth pricing at a partial share when the search picked a configuration
    without optimizer offload: the fastest that fitted, if even with no host step at all (its micro-steps
    alone) it would beat `best` by more than `noise`; else None.

    The search measures optimizer offload with every parameter on the host; the share comes after the pick.
    On an H100 (GPT-2 medium, 16 GiB) compile with full offload measured 63-65 samples/s against 68-70
    without offload, and lost, while with 65% on the host it trained 1.12x faster than the winner
    (89,681 against 81,084 tok/s, one process: benchmarks/bench_trial_steps.py).
    """
    if best.rung.offload == "optimizer":
        return None
    offloaded = [t for t in trials if t.fits and t.rung.offload == "optimizer" and t.step_seconds > 0]
    if not offloaded:
        return None
    rival = max(offloaded, key=lambda t: t.samples_per_second)
    bound = per_rank / global_step_seconds(rival.step_seconds, 0.0, per_rank, rival.micro_batch_size)
    return rival if bound > best.samples_per_second * (1 + noise) else None


def choose_offload_fraction(best: Trial, run: Callable[[float], Trial], params: Sequence[nn.Parameter],
                            limit_bytes: int, state_tensors: int, keep_fp32: Collection[nn.Parameter] = (),
                            *, tries: int = 2, ranks: int = 1) -> tuple[Trial, float, list[Trial], list[str]]:
    """The optimizer-offload trial `best` at a smaller host share, when the arithmetic says one fits.

    Returns (the trial to plan from, its offload fraction, the trials run, notes). A share is kept only
    when its trial fits under the limit; after a miss, half the predicted device share is tried.
    """
    room = (limit_bytes - best.peak_bytes) * ROOM_USED
    fraction = predict_fraction(params, room, state_tensors, keep_fp32, ranks=ranks)
    ran: list[Trial] = []
    for _ in range(tries):
        if fraction >= 1.0:
            break
        trial = run(fraction)
        ran.append(trial)
        if trial.fits:
            return trial, fraction, ran, [f"optimizer offload of {fraction:.0%} of the parameters: the rest fit "
                                          f"on the device at micro-batch {best.micro_batch_size}"]
        room /= 2
        fraction = predict_fraction(params, room, state_tensors, keep_fp32, ranks=ranks)
    note = ("optimizer offload of every parameter: no smaller share fitted" if ran else
            "optimizer offload of every parameter: no room under the limit for a share on the device")
    return best, 1.0, ran, [note]
