"""The picture for render.py: throughput against micro-batch for each rung (from the grid), with autotune's
plan and each peer's answer marked. matplotlib is imported only when drawing; without it nothing is drawn.
"""

from __future__ import annotations

import sys
from typing import Any

from peer_records import SHORT, Workload, rung_name

MARKERS = {"autotune-cold": ("*", "black", 16), "autotune-warm": ("P", "dimgray", 10),
           "accelerate": ("v", "tab:red", 10), "lightning-power": ("^", "tab:purple", 10),
           "lightning-binsearch": ("D", "tab:brown", 8)}


def plot(ws: list[Workload], path: str) -> bool:
    """Throughput against micro-batch per rung (the grid), with each method's answer marked. False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("render: matplotlib is not installed; no plot (pip install matplotlib, then render again)",
              file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, len(ws), figsize=(6.4 * len(ws), 6.4), squeeze=False)
    for ax, w in zip(axes[0], ws):
        _plot_one(ax, w)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _plot_one(ax: Any, w: Workload) -> None:
    g = w.tune.get("grid")
    if g:
        lines: dict[str, list[tuple[int, float, str]]] = {}
        for t in g["grid"]:
            lines.setdefault(rung_name(t["rung"]), []).append(
                (t["micro_batch_size"], t["samples_per_second"] * w.per_sample, t["outcome"]))
        for name, pts in lines.items():
            ran = [(m, y) for m, y, o in pts if o != "oom"]
            (line,) = ax.plot([m for m, _ in ran], [y for _, y in ran], "o-", label=name, alpha=0.8)
            over = [(m, y) for m, y, o in pts if o == "over_budget"]
            ax.plot([m for m, _ in over], [y for _, y in over], "o", mfc="white", color=line.get_color())
            ooms = [m for m, _, o in pts if o == "oom"]
            ax.plot(ooms, [0] * len(ooms), "x", color=line.get_color(), ms=9)
    for method, (marker, color, size) in MARKERS.items():
        t = w.tune.get(method)
        if not t or not t.get("config"):
            continue
        micro = t["config"]["micro_batch_size"]
        y = w.trial_rate(method, ("ok", "over_budget"))
        outcome = w.trial_outcome(method)
        note = {"ok": "", "over_budget": " (over margin)", "oom": " (trial OOM)"}.get(outcome, " (not verified)")
        label = f"{SHORT[method]}: {t['config']['name']} @ {micro}{note}"
        hollow = outcome == "over_budget"
        ax.plot([micro], [y or 0], marker, color=color, ms=size, label=label, zorder=5, mew=2 if hollow else 1,
                mfc="white" if hollow else color, mec=color if hollow else "black")
    gave_up = [SHORT[m] for m in MARKERS if m in w.tune and not w.tune[m].get("config")]
    if gave_up:
        ax.text(0.02, 0.97, "no configuration found: " + ", ".join(gave_up), transform=ax.transAxes, fontsize=8,
                va="top", color="tab:red")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batch size")
    ax.set_ylabel(f"{w.unit}, whole global step (TrialRunner)")
    ax.set_title(f"{w.name}: {w.spec['title']}\n{w.spec['budget']} ceiling, global batch {w.spec['global_batch_size']}"
                 f"{' (SMOKE, CPU)' if w.smoke else ''}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
