"""A picture of one search: what was tried, what it measured, and which plan won.

Left, throughput against micro-batch, one line per configuration tried; right, peak memory against
micro-batch with the budget and the limit (budget less margin) drawn across, and under offload the host memory
each trial raised as a dotted line of squares. The chosen plan is a star
on both; an out-of-memory trial is a cross (on the axis for throughput, which it never measured); a trial
that ran but left too little headroom is a hollow circle. Below, where the trials recorded their phases, one
stacked bar per trial in the order they ran: where its seconds went (set-up, host buffers, compile, warm-up,
measured steps, restore, clean-up). Everything comes from the plan itself, so a
plan from the cache, from `autotune run --json` or from a benchmark's log draws the same.

matplotlib is optional (the `plot` extra, or `pip install matplotlib`), imported only here and only when drawing.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import AutotuneError
from .evidence import TRIAL_PHASES, Trial
from .plan import Plan

INSTALL_HINT = "pip install matplotlib (what the 'plot' extra installs)"
GIB = 2**30


class PlotUnavailable(AutotuneError):
    """Drawing needs matplotlib, which is not installed."""


def require_matplotlib() -> Any:
    """The matplotlib module; raises `PlotUnavailable` naming the install command when it is missing."""
    try:
        return importlib.import_module("matplotlib")
    except ImportError as exc:
        raise PlotUnavailable(f"drawing the search needs matplotlib, an optional extra: {INSTALL_HINT}") from exc


def draw_search(plan: Plan, path: str | Path, *, title: str = "") -> Path:
    """Write the picture of `plan`'s search to `path` (PNG, or any format matplotlib knows by the suffix).

    Args:
        plan: a plan with its trials (`plan.trials`).
        path: where to write; the suffix picks the format.
        title: what was tuned, e.g. the model; the device and the chosen plan are added.

    Returns:
        The path written.

    Raises:
        PlotUnavailable: matplotlib is not installed.
        ValueError: the plan has no trials to draw (a zero-change plan's cache row, say).
    """
    path = Path(path)
    search_figure(plan, title=title).savefig(path, dpi=120)
    return path


def search_figure(plan: Plan, *, title: str = "") -> Any:
    """The `matplotlib.figure.Figure` that `draw_search` writes: axes[0] throughput, axes[1] peak memory (and,
    under offload, the host memory each trial raised)."""
    require_matplotlib()
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend

    if not plan.trials:
        raise ValueError("the plan holds no trials to draw; plot a plan that was tuned (not one built by hand)")
    timed = any(t.phases for t in plan.trials)  # a plan tuned before trials timed their phases has no third panel
    fig = Figure(figsize=(13, 9.0 if timed else 5.2), layout="constrained")
    grid = fig.add_gridspec(2 if timed else 1, 2, height_ratios=[3, 2] if timed else [1])
    speed, memory = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    if timed:
        _draw_phases(fig.add_subplot(grid[1, :]), plan.trials)
    unit, scale = _rate_unit(plan)
    size_unit, size = ("GiB", GIB) if plan.memory_budget_bytes >= GIB else ("MiB", 2**20)
    colors = _colors(plan.trials)
    for rung, color in colors.items():
        tried = [t for t in plan.trials if t.rung.name == rung]
        _draw_rung(speed, tried, color, rung, lambda t: t.samples_per_second * scale)
        _draw_rung(memory, tried, color, rung, lambda t: t.peak_bytes / size)
        _draw_host(memory, tried, color, rung, size)
    _mark_ooms(speed, memory, plan, colors, size)
    _mark_choice(speed, memory, plan, scale, size)
    _limits(memory, plan, size_unit, size)
    _axes(speed, plan.trials, f"throughput ({unit}, whole global step)")
    _axes(memory, plan.trials, f"peak memory ({size_unit})")
    speed.set_ylim(top=max(t.samples_per_second for t in plan.trials) * scale * 1.15 or 1.0)  # room for the label
    _mfu_axis(speed, plan, scale)
    speed.legend(handles=_legend(speed, colors), fontsize=8, loc="best")
    memory.legend(fontsize=8, loc="best")
    fig.suptitle(_title(plan, title), fontsize=11)
    return fig


def _draw_phases(ax: Any, trials: Sequence[Trial]) -> None:
    """One stacked bar per trial, in the order they ran: the seconds of each of its phases."""
    runs = range(1, len(trials) + 1)
    bottom = [0.0] * len(trials)
    for i, phase in enumerate(p for p in TRIAL_PHASES if any(t.phases.get(p) for t in trials)):
        heights = [t.phases.get(phase, 0.0) for t in trials]
        ax.bar(runs, heights, bottom=bottom, color=f"C{i % 10}", label=phase, width=0.7)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(list(runs), [f"{n}\n{t.micro_batch_size}" for n, t in zip(runs, trials)], fontsize=7)
    ax.set_xlabel("trial, in the order run (micro-batch below)")
    ax.set_ylabel("seconds")
    ax.set_title("where each trial's time went", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", ncols=4)
    ax.grid(True, axis="y", alpha=0.3)


def _rate_unit(plan: Plan) -> tuple[str, float]:
    if plan.tokens_per_second and plan.samples_per_second:
        return "tokens/s", plan.tokens_per_second / plan.samples_per_second
    return "samples/s", 1.0


def _colors(trials: Sequence[Trial]) -> dict[str, str]:
    names = list(dict.fromkeys(t.rung.name for t in trials))  # in the order the search tried them
    return {name: f"C{i % 10}" for i, name in enumerate(names)}


def _measured(trials: Sequence[Trial]) -> list[Trial]:
    """Trials that ran, one per micro-batch: a re-measurement (the runoff's longer run) replaces the first."""
    by_micro = {t.micro_batch_size: t for t in trials if t.outcome in ("ok", "over_budget")}
    return [by_micro[m] for m in sorted(by_micro)]


def _draw_rung(ax: Any, trials: Sequence[Trial], color: str, label: str, y: Any) -> None:
    ran = _measured(trials)
    fits = [t for t in ran if t.fits]
    if fits:
        ax.plot([t.micro_batch_size for t in fits], [y(t) for t in fits], "-o", color=color, label=label, ms=6)
    over = [t for t in ran if not t.fits]
    if over:
        ax.plot([t.micro_batch_size for t in over], [y(t) for t in over], "o", mfc="none", mec=color, mew=1.5,
                ms=8, label=None if fits else label)


def _draw_host(ax: Any, trials: Sequence[Trial], color: str, label: str, size: int) -> None:
    """Under offload, the host memory each trial raised, as a dotted line beside the device's peak."""
    host = [t for t in _measured(trials) if t.rung.offload != "none" and t.host_peak_bytes]
    if host:
        ax.plot([t.micro_batch_size for t in host], [t.host_peak_bytes / size for t in host], ":s", color=color,
                label=f"{label}: host memory raised", ms=5)


def _mark_ooms(speed: Any, memory: Any, plan: Plan, colors: dict[str, str], size: int) -> None:
    """OOMs (and failed compiles) measured no throughput: crosses on the micro-batch axis, and on the memory
    side at the peak seen before the failure, or at the budget when none was read."""
    for t in plan.trials:
        if t.outcome in ("oom", "error"):
            marker = "x" if t.outcome == "oom" else "+"
            speed.plot([t.micro_batch_size], [0], marker, color=colors[t.rung.name], ms=10, mew=2, clip_on=False)
            peak = t.peak_bytes if t.peak_bytes else plan.memory_budget_bytes
            memory.plot([t.micro_batch_size], [peak / size], marker, color=colors[t.rung.name], ms=10, mew=2)


def _mark_choice(speed: Any, memory: Any, plan: Plan, scale: float, size: int) -> None:
    micro = plan.micro_batch_size
    star = {"marker": "*", "ms": 20, "mfc": "gold", "mec": "black", "zorder": 5, "linestyle": "none"}
    speed.plot([micro], [plan.samples_per_second * scale], **star)
    memory.plot([micro], [plan.peak_memory_bytes / size], **star)
    speed.annotate("chosen", (micro, plan.samples_per_second * scale), textcoords="offset points", xytext=(8, 8),
                   fontsize=9, weight="bold")


def _limits(memory: Any, plan: Plan, unit: str, size: int) -> None:
    budget = plan.memory_budget_bytes / size
    memory.axhline(budget, color="gray", linestyle=":", label=f"budget {budget:,.1f} {unit}")
    memory.axhline(budget * (1 - plan.margin), color="red", linestyle="--",
                   label=f"limit: budget less {plan.margin:.0%} margin")
    highest = max([plan.peak_memory_bytes, *(max(t.peak_bytes, t.host_peak_bytes) for t in plan.trials)]) / size
    memory.set_ylim(0, max(budget, highest) * 1.08)


def _axes(ax: Any, trials: Sequence[Trial], ylabel: str) -> None:
    micros = sorted({t.micro_batch_size for t in trials})
    if micros[-1] >= 4 * micros[0]:
        ax.set_xscale("log", base=2)  # micro-batches grow by doubling
    ax.set_xticks(micros, [str(m) for m in micros])
    ax.minorticks_off()
    ax.set_xlabel("micro-batch size")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)


def _mfu_axis(ax: Any, plan: Plan, scale: float) -> None:
    """MFU is throughput over a constant (FLOPs per sample x ranks / peak): a second scale on the same axis."""
    if plan.mfu is None or not plan.samples_per_second:
        return
    per_unit = plan.mfu / (plan.samples_per_second * scale)
    axis = ax.secondary_yaxis("right", functions=(lambda v: v * per_unit * 100, lambda p: p / (per_unit * 100)))
    axis.set_ylabel(f"MFU (%) at {plan.precision}")


def _legend(ax: Any, colors: dict[str, str]) -> list[Any]:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, marker="o", label=name) for name, c in colors.items()]
    handles += [Line2D([], [], linestyle="none", marker="o", mfc="none", mec="black", label="over the limit"),
                Line2D([], [], linestyle="none", marker="x", color="black", mew=2, label="out of memory"),
                Line2D([], [], linestyle="none", marker="*", ms=14, mfc="gold", mec="black", label="chosen plan")]
    return handles


def _title(plan: Plan, title: str) -> str:
    rate = (f"{plan.tokens_per_second:,.0f} tokens/s" if plan.tokens_per_second
            else f"{plan.samples_per_second:,.1f} samples/s")
    mfu = f", MFU {plan.mfu:.1%}" if plan.mfu is not None else ""
    what = f"{title} on " if title else ""
    took = f" in {plan.evidence.tune_seconds:,.1f} s" if plan.evidence.tune_seconds else ""
    return (f"{what}{plan.device_name or plan.device}: {len(plan.trials)} trials{took}; chosen {plan.rung.name}, "
            f"micro-batch {plan.micro_batch_size} x {plan.accumulation_steps} accumulation, {rate}{mfu}")
