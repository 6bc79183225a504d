"""Render bench_peers.py's JSON lines into benchmarks/RESULTS.md (its "Peers" section) and a PNG plot.

    python benchmarks/render.py benchmarks/data/peers.jsonl
    python benchmarks/render.py a.jsonl b.jsonl --results benchmarks/RESULTS.md --plot benchmarks/peers.png

Only the text between `<!-- peers:begin -->` and `<!-- peers:end -->` is replaced (the markers are added at
the end of the file when absent); other sections of RESULTS.md are left alone. Every figure in the table
cites the line it came from (`file:line`). Where autotune is behind a peer or the grid on any figure, the
section says so. The plot needs matplotlib (imported only here); without it the table is still written.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_records import AUTOTUNE, LABELS, METHODS, SHORT, Workload, load, rung_name, workloads
from workloads import config_key

BEGIN, END = "<!-- peers:begin -->", "<!-- peers:end -->"
# -- table cells --------------------------------------------------------------------------------------
def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def describe(config: dict[str, Any] | None) -> str:
    if not config:
        return "none"
    text = f"{config['name']}, micro-batch {config['micro_batch_size']} × {config['accumulation_steps']}"
    if config["last_micro_batch_size"] != config["micro_batch_size"]:
        text += f" (last {config['last_micro_batch_size']})"
    return text


def row(w: Workload, method: str) -> dict[str, str]:
    """The table's cells for one method."""
    t = w.tune.get(method)
    if t is None:
        p = w.problems.get(method)
        why = (p.get("error") or p.get("reason") or "") if p else "not run"
        return {"method": LABELS[method], "trials": "", "ooms": "", "time": "", "config": f"— ({why})",
                "rate": "", "ratio": "", "steps": "", "at": p["_at"] if p else ""}
    config = describe(t.get("config"))
    if t.get("error"):
        config = f"none: gave up ({t['error']})"
    notes = [n for n in (t.get("note"), "cache hit" if t.get("source") == "cache" else "") if n]
    if notes:
        config += f" — {'; '.join(notes)}"
    v = w.verification(method)
    rate = w.train_rate(method)
    ratio, how = w.ratio(method)
    return {"method": LABELS[method], "trials": str(t["trials"]), "ooms": str(t["ooms"]),
            "time": _seconds(t["tune_seconds"]), "config": config,
            "rate": _num(rate) if rate else _rate_missing(w, method),
            "ratio": f"{ratio:.2f}×{' (' + how + ')' if how else ''}" if ratio else "",
            "steps": _steps(v, w.verify_errors.get(config_key(t["config"])) if t.get("config") else None),
            "at": ", ".join(x for x in (t["_at"], v["_at"] if v else "") if x)}


def _seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.1f} s"


def _rate_missing(w: Workload, method: str) -> str:
    v = w.verification(method)
    if not (w.tune[method].get("config")):
        return "—"
    if v is None:
        est = w.trial_rate(method)
        return f"{_num(est)} (est., not verified)" if est else "not verified"
    train = v.get("train")
    if train and train["oom"]:
        return "OOM in training"
    return "—"


def _steps(v: dict[str, Any] | None, error: dict[str, Any] | None = None) -> str:
    if v is None:
        if error is None:
            return "not run"
        if error["kind"] == "skip":
            return f"not run ({error['reason']}) [{error['_at']}]"
        return f"verification failed: {error['error']} [{error['_at']}]"
    train = v.get("train")
    if not train:
        return "not run (--steps 0)"
    done, asked = train["steps_done"], train["steps_requested"]
    if train["oom"]:
        return f"**no**: OOM in step {done + 1} of {asked}"
    if train.get("stopped"):
        return f"yes for {done} of {asked} (stopped: {train['stopped']})"
    return f"yes, {done} of {asked}"


# -- where autotune is behind -------------------------------------------------------------------------
def behind(w: Workload) -> list[str]:
    """One plain sentence per figure on which an autotune row is worse than a peer or the grid, by figure."""
    out: list[str] = []
    cold, warm = w.tune.get("autotune-cold"), w.tune.get("autotune-warm")
    one_plan = bool(cold and warm and cold.get("config") and warm.get("config")
                    and config_key(cold["config"]) == config_key(warm["config"]))
    for mine in AUTOTUNE:
        t = w.tune.get(mine)
        if t is None:
            continue
        me = SHORT[mine]
        plan_too = not (mine == "autotune-warm" and one_plan)  # the plan's figures are said once for both
        plan_me = "autotune (cold and warm: the same plan)" if one_plan else me
        for other in METHODS:
            o = w.tune.get(other)
            if other in AUTOTUNE or o is None:
                continue
            them = SHORT[other] + (" (which then found no configuration)" if not o.get("config") else "")
            cites = f"[{t['_at']}, {o['_at']}]"
            if o["trials"] < t["trials"]:
                out.append(f"Trials: {me} ran {t['trials']}, {them} {o['trials']} {cites}.")
            if o["ooms"] < t["ooms"]:
                out.append(f"OOMs while tuning: {me} hit {t['ooms']}, {them} {o['ooms']} {cites}.")
            if o["tune_seconds"] < t["tune_seconds"]:
                out.append(f"Tuning time: {me} took {_seconds(t['tune_seconds'])}, {them} "
                           f"{_seconds(o['tune_seconds'])} {cites}." + _time_reason(w, mine, other))
            if plan_too:
                out += _rate_behind(w, mine, other, plan_me)
        if plan_too and w.steps_ok(mine) is False:
            v = w.verification(mine)
            out.append(f"Training: {plan_me}'s plan ran out of memory in step {v['train']['steps_done'] + 1} of "
                       f"{v['train']['steps_requested']} ({v['train']['error']}) [{v['_at']}].")
    order = ("Trials", "OOMs", "Tuning time", "Throughput", "Training")
    return sorted(out, key=lambda line: next(i for i, o in enumerate(order) if line.startswith(o)))


def _rate_behind(w: Workload, mine: str, other: str, me: str) -> list[str]:
    a, b = w.train_rate(mine), w.train_rate(other)
    how = "whole global steps in training"
    if not _trained(w, mine) and not _trained(w, other):  # --steps 0: only the TrialRunner's estimates exist
        a, b, how = w.trial_rate(mine), w.trial_rate(other), "trial estimates"
    if not (a and b) or a >= b:
        return []
    cfg_a, cfg_b = w.tune[mine]["config"], w.tune[other]["config"]
    same = config_key(cfg_a) == config_key(cfg_b)
    why = (" The same configuration, measured in two processes: run-to-run noise." if same else
           f" autotune chose {describe(cfg_a)}; {SHORT[other]}: {describe(cfg_b)}.")
    cites = ", ".join((w.verification(m) or w.tune[m])["_at"] for m in (mine, other))
    return [f"Throughput: {me} {_num(a)} {w.unit}, {SHORT[other]} {_num(b)} {w.unit} ({a / b:.2f}×, {how})."
            f"{why} [{cites}]"]


def _trained(w: Workload, method: str) -> bool:
    return bool((w.verification(method) or {}).get("train"))


def _time_reason(w: Workload, mine: str, other: str) -> str:
    t = w.tune[mine]
    if other == "grid":
        return ""
    if t.get("source") == "cache":
        return " (a cache hit: no trials, the time is the lookup and process work)"
    if not w.tune[other].get("config"):
        return " Why: autotune climbs to a rung that fits; the peer only shrinks the batch, then gives up."
    steps = w.spec.get("trial_steps", 3)
    return (f" Why: autotune runs each trial for 1 warm-up and {steps} measured step{'s' if steps > 1 else ''} "
            "and also times rungs above the first that fits, to choose by throughput; the peer stops at the "
            "largest batch that survives its probe.") if t["trials"] else ""


# -- markdown -----------------------------------------------------------------------------------------
COLUMNS = (("method", "Method"), ("trials", "Trials"), ("ooms", "OOMs tuning"), ("time", "Tuning time"),
           ("config", "Chosen configuration"), ("rate", "{unit}, global step"), ("ratio", "× grid best"),
           ("steps", "Steps without OOM"), ("at", "Lines"))


def table(w: Workload) -> str:
    heads = [h.format(unit=w.unit) for _, h in COLUMNS]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for method in METHODS:
        if method in w.tune or method in w.problems:
            cells = row(w, method)
            lines.append("| " + " | ".join(cells[k].replace("|", "\\|") for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def grid_table(w: Workload) -> str:
    g = w.tune.get("grid")
    if not g:
        return ""
    sizes = sorted({t["micro_batch_size"] for t in g["grid"]})
    rungs: dict[str, dict[int, str]] = {}
    for t in g["grid"]:
        name = rung_name(t["rung"])
        cell = {"ok": _num(t["samples_per_second"] * w.per_sample), "oom": "OOM",
                "over_budget": f"{_num(t['samples_per_second'] * w.per_sample)} (over margin)"}[t["outcome"]]
        rungs.setdefault(name, {})[t["micro_batch_size"]] = cell
    for e in g.get("errors", []):
        rungs.setdefault(e["rung"], {})[e["micro_batch_size"]] = "error"
        sizes = sorted(set(sizes) | {e["micro_batch_size"]})
    lines = ["| rung \\ micro-batch | " + " | ".join(map(str, sizes)) + " |", "|" + "---|" * (len(sizes) + 1)]
    for name, cells in rungs.items():
        lines.append(f"| {name} | " + " | ".join(cells.get(m, "") for m in sizes) + " |")
    done = "" if g.get("complete", True) else " The grid was cut short by the deadline."
    done += "".join(f" {e['rung']} at micro-batch {e['micro_batch_size']} failed, not for memory: {e['error']} "
                    "(the grid went on with the next rung)." for e in g.get("errors", []))
    return (f"Grid [{g['_at']}]: {w.unit} estimated for a whole global step by autotune's TrialRunner; OOM: "
            f"out of memory; over margin: ran but above 90% of the ceiling, so not eligible.{done}\n\n"
            + "\n".join(lines))


def facts(w: Workload) -> str:
    last = next((r for r in reversed(w.records) if r.get("device")), w.records[-1])
    versions = ", ".join(f"{k} {v}" for k, v in sorted((last.get("versions") or {}).items()))
    dates = sorted({r["date"] for r in w.records if r.get("date")})
    commands = sorted({r["command"] for r in w.records if r.get("command")})
    span = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}" if dates else "?"
    cmd = "\n".join(f"    {c}" for c in commands)
    cuda = f" (CUDA {last['cuda']})" if last.get("cuda") else ""
    return (f"Device: {w.device} · torch {last.get('torch')}{cuda} · {versions} · {span}\n\n"
            f"Commands:\n\n{cmd}")


def section(ws: list[Workload], files: list[str], plot: str | None, command: str) -> str:
    out = [BEGIN, "## autotune beside its peers", "",
           f"Generated by `{command}` from {', '.join(f'`{f}`' for f in files)}; each figure cites its "
           "`file:line`. How it is measured: `benchmarks/README.md`. Trials and OOMs count the tries each method "
           "made while tuning; the throughput is of whole global steps (accumulation included) in a fresh "
           "process training at the chosen configuration, the same loop for every method; × grid best divides "
           "it by the same figure for the grid's best configuration (est.: TrialRunner estimates, when training "
           "figures are missing).", ""]
    if any(w.smoke for w in ws):
        out += ["**Smoke run: tiny CPU stand-ins under a simulated memory ceiling. These figures test the "
                "pipeline; they say nothing about performance.**", ""]
    if plot:
        out += [f"![{', '.join(w.name for w in ws)}: throughput against micro-batch]({plot})", ""]
    for w in ws:
        out += [f"### {w.name}: {w.spec['title']}; {w.spec['budget']} ceiling, "
                f"global batch {w.spec['global_batch_size']}",
                "", facts(w), "", table(w), ""]
        lost = behind(w)
        out += ["**Where autotune is behind:**", ""]
        if lost:
            out += [f"- {s}" for s in lost]
        elif not any(m in w.tune for m in AUTOTUNE):
            out += ["- autotune did not run in these records: nothing to compare."]
        else:
            out += ["- Nowhere in these records: on every figure above, autotune is level with or ahead of each "
                    "peer and the grid that ran."]
        for e in (w.tune.get("grid") or {}).get("errors", []):
            out += [f"- Note: the grid's {e['rung']} rung failed at micro-batch {e['micro_batch_size']} with an error "
                    f"that is not an OOM ({e['error']}) [{w.tune['grid']['_at']}]: autotune's rung, not the benchmark."]
        for r in w.other_problems:
            out += [f"- Note: {r.get('label') or r.get('stage')}: {r.get('error') or r.get('reason')} [{r['_at']}]"]
        grid = grid_table(w)
        if grid:
            out += ["", "<details><summary>The grid, every rung × micro-batch</summary>", "", grid, "", "</details>"]
        out.append("")
    out.append(END)
    return "\n".join(out)


def write_section(path: str, text: str) -> None:
    """Replace the text between the markers (inclusive) in `path`, or append it at the end."""
    old = ""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
    if BEGIN in old and END in old and old.index(BEGIN) < old.index(END):
        new = old[:old.index(BEGIN)] + text + old[old.index(END) + len(END):]
    else:
        new = (old.rstrip("\n") + "\n\n" if old.strip() else "") + text + "\n"
    with open(path, "w") as f:
        f.write(new)


def text_summary(records: list[dict[str, Any]]) -> str:
    """A plain-text version of the tables, for the console."""
    out = []
    for w in workloads([r for r in records if "workload" in r]):
        out.append(f"\n{w.name} ({w.spec['title']}, {w.spec['budget']}, global batch {w.spec['global_batch_size']}) "
                   f"on {w.device}")
        for method in METHODS:
            if method in w.tune or method in w.problems:
                c = row(w, method)
                out.append(f"  {SHORT[method]:20} trials {c['trials']:>3} ooms {c['ooms']:>3} {c['time']:>9}  "
                           f"{c['config'][:70]:70} {c['rate']:>12} {w.unit} {c['ratio']:>6}  {c['steps']}")
        for s in behind(w):
            out.append(f"  behind: {s}")
    return "\n".join(out)


# -- command line -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """`argv`: the arguments after the script's name (default: the command line's)."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="JSON-lines files from bench_peers.py")
    p.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"))
    p.add_argument("--plot", default=None, help="PNG path; default peers.png beside --results")
    p.add_argument("--workload", action="append", help="only these workloads (default: all in the files)")
    args = p.parse_args(argv)
    records = [r for r in load(args.files) if "workload" in r]
    ws = [w for w in workloads(records) if not args.workload or w.name in args.workload]
    if not ws:
        p.error("no bench_peers records in the files")
    plot_path = args.plot or os.path.join(os.path.dirname(os.path.abspath(args.results)), "peers.png")
    import plot  # matplotlib is needed only here

    drew = plot.plot(ws, plot_path)
    rel = os.path.relpath(plot_path, os.path.dirname(os.path.abspath(args.results))) if drew else None
    command = "python benchmarks/render.py " + " ".join(argv)
    write_section(args.results, section(ws, args.files, rel, command))
    print(f"render: wrote {args.results}" + (f" and {plot_path}" if drew else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
