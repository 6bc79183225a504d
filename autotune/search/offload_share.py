"""Step after the pick: the offload share. Decides, under optimizer offload, the smallest share of the
parameters on the host that still fits (`offload_share`).

Full optimizer offload moves every FP32 master and all optimizer state to the host, and the CPU then steps
every parameter. When the chosen micro-batch leaves room under the limit, part of that can stay on the
device and be stepped there (Megatron-Core's `offload_fraction`): less host work, less PCIe traffic. Which
share, by memory arithmetic on the measured peak of full offload, then checked by one trial:

    peak(share kept on the device) ~ peak(full offload) + sum over kept parameters of bytes_to_device(p)

Optimizer offload keeps the first parameters in model order on the device (`host_share`), so the arithmetic
walks them in that order and keeps as many as the room allows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from torch import nn

from ..evidence import Trial
from ..sizes import format_bytes, format_share
from ..techniques.offload import host_share, norm_parameters
from ..techniques.offload import partition as offload_partition
from ..techniques.offload.partition import runs
from ..workload.batching import global_step_seconds
from ..workload.optimizers import state_tensors_per_parameter
from .ledger import Ledger
from .lines import NOISE

ROOM_USED = 0.85  # share of the measured room the arithmetic may fill: the device optimizer's own step
# temporaries and allocator rounding are not in it, and a trial that runs over costs a second one
REFINE_BELOW = 0.5  # a share's trial that grew the peak by less than this part of the arithmetic earns one more
MIN_SCALE = 0.25  # the arithmetic's cost per parameter is scaled down at most this far by one measurement
MIN_STEP = 0.05  # a refined share must move at least this much to be worth a trial


def offload_share(s: Ledger) -> Ledger:
    """Step: under optimizer offload, the smallest host share that fits the chosen micro-batch (not over FSDP2:
    sharded ranks hold a share of each parameter already).

    Replicated ranks choose it too, alike: every rank runs the same share trials, whose outcomes the ranks
    agree on (`TrialRunner`'s `agree`), and the arithmetic is the same on each; left at the whole model, the
    ranks would stream all of the optimizer state every step.

    When the search picked a configuration without optimizer offload, its fastest offload rival is priced
    at a share too (`offload_rival`) and replaces the pick only if it is faster by more than noise."""
    best, ctx = s.picked(), s.afterwards()
    work = ctx.work
    if ctx.sharded:
        return s
    candidate = best if best.rung.offload == "optimizer" else offload_rival(s.trials, best, work.per_rank, NOISE)
    if candidate is None:
        return s
    if candidate.rung in ctx.host_shares:  # the host holds all it can already: its trials ran at that share
        if candidate is best:
            s.fraction = ctx.host_shares[candidate.rung]
        return s
    trainable = [p for p in work.model.parameters() if p.requires_grad]
    params = [trainable[i] for i in work.spec.held()]  # what the host optimizer splits: the parameters it trains
    chosen, fraction, ran, notes = choose_offload_fraction(
        candidate, lambda f: ctx.run(candidate.rung, candidate.micro_batch_size, offload_fraction=f), params,
        work.limit_bytes, state_tensors_per_parameter(work.spec), norm_parameters(work.model),
        ranks=offload_partition.ranks(candidate.rung.precision, ctx.sharded))
    s.trials.extend(ran)
    if candidate is not best:
        return rival_or_pick(s, chosen if chosen is not candidate else None, fraction)
    s.notes.extend(notes)
    if chosen is not best:
        s.found("offload share", notes[0])
    s.pick, s.fraction = chosen, fraction
    return s


def rival_or_pick(s: Ledger, shared: Trial | None, fraction: float) -> Ledger:
    """The search's pick, or the offload rival at its share where that measured faster by more than noise."""
    best = s.picked()
    if shared is None or shared.samples_per_second <= best.samples_per_second * (1 + NOISE):
        what = (f"{shared.samples_per_second:,.1f} samples/s with {format_share(fraction)} of the parameters' "
                "optimizer on the host" if shared is not None else "no share on the device fitted")
        s.notes.append(f"optimizer offload priced at a partial share: {what}, not faster than the pick")
        return s
    s.found("offload share", f"{shared.rung.name} at micro-batch {shared.micro_batch_size} with "
            f"{format_share(fraction)} of the parameters' optimizer on the host: "
            f"{shared.samples_per_second / best.samples_per_second:.2f}x {best.rung.name} at micro-batch "
            f"{best.micro_batch_size}, the pick with the whole optimizer offloaded or none", leads=True)
    s.pick, s.fraction = shared, fraction
    return s


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

    `ranks` > 1: the device share is partitioned over that many replicated ranks (techniques/offload/partition.py), each
    holding the masters and state of its run of whole parameters; the rank with the dearest run must fit.
    Not 1/ranks of the share: a language model's first parameters are its token embedding, one tensor one
    rank holds whole, so a small device share can land entirely on one rank."""
    total = sum(p.numel() for p in params)
    costs = _costs(params, state_tensors, keep_fp32)
    numels = [p.numel() for p in params]
    kept = 0
    while kept < len(params) - 1 and _dearest_run(costs, numels, kept + 1, ranks) <= room_bytes:
        kept += 1
    return 1.0 - sum(numels[:kept]) / total if total else 1.0


def _costs(params: Sequence[nn.Parameter], state_tensors: int, keep_fp32: Collection[nn.Parameter]) -> list[int]:
    fp32 = {id(p) for p in keep_fp32}
    return [bytes_to_device(p, state_tensors, keep_fp32=id(p) in fp32) for p in params]


def _dearest_run(costs: Sequence[int], numels: Sequence[int], kept: int, ranks: int) -> int:
    """What keeping the first `kept` parameters on the device costs the rank whose run of them costs most (the
    only rank, unpartitioned): the runs the shares' partition cuts, balanced by elements."""
    # fewer than the ranks: every rank steps all of them (techniques/offload/partition.py)
    if ranks <= 1 or kept < ranks:
        return sum(costs[:kept])
    return max(sum(costs[i] for i in run) for run in runs(range(kept), numels, ranks))


def offload_rival(trials: Sequence[Trial], best: Trial, per_rank: int, noise: float) -> Trial | None:
    """The optimizer-offload trial worth pricing at a partial share when the search picked a configuration
    without optimizer offload: the fastest that fitted, if even with no host step at all (its micro-steps
    alone) it would beat `best` by more than `noise`; else None.

    The search measures optimizer offload with every parameter on the host; the share comes after the pick.
    A configuration with every parameter's optimizer on the host can lose to one without offload while the
    same configuration with only part of it there beats both (benchmarks/bench_trial_steps.py measures it).
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
            refined, fraction, why = _refine(best, trial, fraction, run, params, limit_bytes, state_tensors,
                                             keep_fp32, ranks, ran)
            return refined, fraction, ran, [f"optimizer offload of {format_share(fraction)} of the parameters: the "
                                            f"rest fit on the device at micro-batch {best.micro_batch_size}{why}"]
        room /= 2
        fraction = predict_fraction(params, room, state_tensors, keep_fp32, ranks=ranks)
    note = ("optimizer offload of every parameter: no smaller share fitted" if ran else
            "optimizer offload of every parameter: no room under the limit for a share on the device")
    return best, 1.0, ran, [note]


def _refine(best: Trial, trial: Trial, fraction: float, run: Callable[[float], Trial], params: Sequence[nn.Parameter],
            limit_bytes: int, state_tensors: int, keep_fp32: Collection[nn.Parameter], ranks: int,
            ran: list[Trial]) -> tuple[Trial, float, str]:
    """One smaller share when the trial at `fraction` grew the peak by much less than the arithmetic said.

    The arithmetic charges every parameter kept on the device its state at the peak; where the peak sits
    elsewhere (in backward, with the state small beside the activations), it overcharges, and leaves device
    memory unused while the rest streams every step. The arithmetic's cost per parameter, scaled by
    what the trial measured (at most MIN_SCALE down), predicts one more share; its trial is kept when it fits
    and is not slower. Returns (trial, fraction, a note on the refinement or "").
    """
    numels = [p.numel() for p in params]
    kept = len(params) - len(host_share(numels, fraction))  # host_share takes the last parameters
    predicted = _dearest_run(_costs(params, state_tensors, keep_fp32), numels, kept, ranks)
    grew = trial.peak_bytes - best.peak_bytes
    if predicted <= 0 or grew >= REFINE_BELOW * predicted:
        return trial, fraction, ""
    scale = max(grew / predicted, MIN_SCALE)
    room = (limit_bytes - best.peak_bytes) * ROOM_USED / scale
    smaller = predict_fraction(params, room, state_tensors, keep_fp32, ranks=ranks)
    if smaller > fraction - MIN_STEP:
        return trial, fraction, ""
    other = run(smaller)
    ran.append(other)
    measured = (f"{format_share(fraction)} on the host grew the peak by {format_bytes(grew)} "
                f"of {format_bytes(int(predicted))} predicted")
    if other.fits and other.samples_per_second >= trial.samples_per_second:
        return other, smaller, f" ({measured}, so {format_share(smaller)} was tried and kept)"
    return trial, fraction, f" ({measured}; {format_share(smaller)}: {'slower' if other.fits else other.outcome})"
