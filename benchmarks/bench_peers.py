"""autotune beside its peers, on the same GPU in the same run, each method in its own process.

Methods (each a fresh process, so one's fragmentation cannot help or hurt another):
    autotune-cold        autotune.fit with an empty plan cache (a fresh temporary directory)
    autotune-warm        autotune.fit again on the same cache: a hit, no trials
    accelerate           accelerate.utils.find_executable_batch_size from its default start (128)
    lightning-power      lightning Tuner.scale_batch_size(mode="power")
    lightning-binsearch  lightning Tuner.scale_batch_size(mode="binsearch")
    grid                 every autotune rung x micro-batch size: the reference best

Then every distinct answer is verified in a fresh process of its own: autotune's TrialRunner times it
(the measure the grid uses), and `--steps` optimizer steps of real training over the global batch (BF16
autocast via the rung, the accumulation that keeps the global batch, no OOM recovery) say whether it
holds and how fast a whole global step runs. Results are JSON lines (`--out`); render them with
benchmarks/render.py. Each invocation stops starting work at `--deadline` seconds and records what it
skipped, so one command fits the GPU machine's 10-minute limit.

    python benchmarks/bench_peers.py --workload W1 --methods grid,autotune-cold,autotune-warm --out r.jsonl
    python benchmarks/bench_peers.py --workload W3 --steps 100 --out r.jsonl          # all methods
    python benchmarks/bench_peers.py --smoke --workload W1 --steps 2 --out smoke.jsonl  # CPU, simulated
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import torch  # noqa: E402
import workloads as wl  # noqa: E402

from autotune.plan import Rung  # noqa: E402

METHODS = ("autotune-cold", "autotune-warm", "accelerate", "lightning-power", "lightning-binsearch", "grid")
PEER_MODULES = {"accelerate": "accelerate", "lightning-power": "lightning", "lightning-binsearch": "lightning"}
RECORDED_ERROR = 3  # a child's exit status after it recorded its own failure
CHILD_SLACK = 20.0  # seconds a child is given, past its soft stop, to write its record and exit


# -- records ------------------------------------------------------------------------------------------
config_of, config_key = wl.config_of, wl.config_key


def append(path: str, record: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read(paths: list[str]) -> list[dict[str, Any]]:
    out = []
    for path in paths:
        if os.path.exists(path):
            with open(path) as f:
                out += [json.loads(line) for line in f if line.strip()]
    return out


# -- the methods (run in a child process) -------------------------------------------------------------
def tune_autotune(spec: wl.Spec, args: argparse.Namespace) -> dict[str, Any]:
    import autotune

    model, batch, loss_fn = wl.build(spec)
    started = time.perf_counter()
    plan = autotune.fit(model, batch, global_batch_size=spec.global_batch_size, memory_budget=spec.budget,
                        device=spec.device, cache=args.cache, loss_fn=loss_fn, trial_steps=spec.trial_steps)
    seconds = time.perf_counter() - started
    ran = [] if plan.source == "cache" else list(plan.trials)  # a hit carries the trials it was tuned with
    note = ""
    if args.method == "autotune-warm" and plan.source != "cache":
        note = "cache miss: the warm run tuned again (the plan cache did not return the cold run's plan)"
    return {"trials": len(ran), "ooms": sum(t.outcome == "oom" for t in ran), "tune_seconds": seconds,
            "config": config_of(plan.rung, plan.micro_batch_size, spec.global_batch_size, plan.offload_fraction),
            "source": plan.source,
            "reason": plan.reason, "tries": [_try(t) for t in ran], "note": note,
            "estimated_samples_per_second": plan.samples_per_second}


def tune_peer(spec: wl.Spec, args: argparse.Namespace) -> dict[str, Any]:
    import peers

    peers.preload(args.method)
    model, batch, loss_fn = wl.build(spec)
    started = time.perf_counter()
    if args.method == "accelerate":
        found = peers.accelerate_search(spec, model, batch, loss_fn, spec.device, args.probe_steps)
    else:
        mode = args.method.split("-", 1)[1]
        found = peers.lightning_search(spec, model, batch, loss_fn, spec.device, mode, args.probe_steps)
    seconds = time.perf_counter() - started
    answer, note = found["answer"], ""
    if answer is not None and answer > spec.global_batch_size:
        note = (f"answered {answer}, above the global batch {spec.global_batch_size}: "
                f"trained at {spec.global_batch_size}")
    tries = found["tries"]
    return {"trials": len(tries), "ooms": sum(t["outcome"].startswith("oom") for t in tries), "tune_seconds": seconds,
            "answer": answer, "error": found["error"], "tries": tries, "note": note,
            "config": config_of(Rung(), answer, spec.global_batch_size) if answer else None}


def tune_grid(spec: wl.Spec, args: argparse.Namespace) -> dict[str, Any]:
    model, batch, loss_fn = wl.build(spec)
    runner, rungs = wl.trial_runner(spec, model, batch, loss_fn, spec.device)

    def show(t: Any) -> None:
        print(f"grid {t.rung.name:36} {t.micro_batch_size:4d} {t.outcome:11} {t.peak_bytes / 2**30:7.3f} GiB "
              f"{t.samples_per_second * spec.per_sample:10.0f} {spec.unit}", flush=True)

    started = time.perf_counter()
    sizes = tuple(int(m) for m in args.grid_micro.split(",")) if args.grid_micro else spec.grid_micro
    result = wl.grid(runner, rungs, sizes, spec.global_batch_size, show, args.stop_at)
    trials, complete = result.trials, result.complete
    best = wl.best_trial(trials)
    return {"trials": len(trials) + len(result.errors), "ooms": sum(t.outcome == "oom" for t in trials),
            "tune_seconds": time.perf_counter() - started, "complete": complete, "errors": result.errors,
            "grid": [t.to_dict() for t in trials], "rungs": [r.name for r in rungs],
            "config": config_of(best.rung, best.micro_batch_size, spec.global_batch_size) if best else None,
            "estimated_samples_per_second": best.samples_per_second if best else 0.0,
            "note": "" if complete else "stopped at the command deadline: the grid is incomplete"}


def verify(spec: wl.Spec, args: argparse.Namespace) -> dict[str, Any]:
    """Time the configuration with autotune's TrialRunner, then train `--steps` steps at it."""
    config = json.loads(args.config)
    rung, micro, share = wl.config_rung(config), config["micro_batch_size"], config.get("offload_fraction", 1.0)
    model, batch, loss_fn = wl.build(spec)
    runner, _ = wl.trial_runner(spec, model, batch, loss_fn, spec.device)
    trial = runner(rung, micro, offload_fraction=share)
    print(f"verify {rung.name} micro-batch {micro}: trial {trial.outcome}, "
          f"{trial.samples_per_second * spec.per_sample:,.0f} {spec.unit} (estimated)", flush=True)
    train = None
    if args.steps > 0:
        train = wl.train_steps(spec, model, batch, loss_fn, spec.device, rung, micro, args.steps, args.stop_at,
                               offload_fraction=share)
        print(f"verify {rung.name} micro-batch {micro}: {train['steps_done']}/{args.steps} steps, "
              f"oom={train['oom']}, {train['samples_per_second'] * spec.per_sample:,.0f} {spec.unit}", flush=True)
    return {"config": config, "methods": args.for_methods.split(","), "trial": trial.to_dict(), "train": train}


def _try(t: Any) -> dict[str, Any]:
    return {"rung": t.rung.name, "micro_batch_size": t.micro_batch_size, "outcome": t.outcome,
            "samples_per_second": t.samples_per_second, "peak_bytes": t.peak_bytes}


def child(args: argparse.Namespace) -> int:
    spec = wl.workloads(args.smoke)[args.workload[0]]
    base = {"kind": args.child, "run_id": args.run_id, "command": args.command, "smoke": args.smoke,
            "workload": spec.name, "spec": spec.info(), **wl.environment(spec.device)}
    if args.child == "tune":
        base["method"] = args.method
    try:
        wl.cap_memory(spec.device, spec.budget)
        # torch imports its compiler stack at the first optimizer built in a process (seconds): pay it before
        # any method's clock starts, as a training script that built its optimizer already has.
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
        if args.child == "verify":
            body = verify(spec, args)
        elif args.method == "grid":
            body = tune_grid(spec, args)
        elif args.method.startswith("autotune"):
            body = tune_autotune(spec, args)
        else:
            body = tune_peer(spec, args)
    except Exception as exc:  # noqa: BLE001 - recorded, so the table says what broke
        traceback.print_exc()
        append(args.out, {**base, "kind": "error", "stage": args.child, "config": json.loads(args.config or "null"),
                          "error": f"{type(exc).__name__}: {str(exc).strip()[:500]}"})
        return RECORDED_ERROR
    append(args.out, {**base, **body})
    return 0


# -- the driver ---------------------------------------------------------------------------------------
class Driver:
    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.args = args
        self.run_id = uuid.uuid4().hex[:12]
        self.deadline = time.time() + args.deadline if args.deadline else None
        self.command = "python benchmarks/bench_peers.py " + " ".join(shlex.quote(a) for a in argv)

    def spawn(self, spec: wl.Spec, stage: str, extra: list[str], label: str) -> None:
        which = {"method": extra[extra.index("--method") + 1] if "--method" in extra else None,
                 "config": json.loads(extra[extra.index("--config") + 1]) if "--config" in extra else None}
        remaining = self.deadline - time.time() if self.deadline else None
        if remaining is not None and remaining < 2 * CHILD_SLACK:
            print(f"[{spec.name}] {label}: not started, the command deadline is near", flush=True)
            self.record(spec, {"kind": "skip", "stage": stage, "label": label, **which, "reason":
                               f"not started: under {2 * CHILD_SLACK:.0f} s left of "
                               f"--deadline {self.args.deadline:.0f}"})
            return
        cmd = [sys.executable, os.path.abspath(__file__), "--child", stage, "--workload", spec.name,
               "--out", self.args.out, "--run-id", self.run_id, "--command", self.command,
               "--steps", str(self.args.steps), "--probe-steps", str(self.args.probe_steps),
               "--grid-micro", self.args.grid_micro, *extra]
        if self.args.smoke:
            cmd.append("--smoke")
        if self.deadline:
            cmd += ["--stop-at", str(self.deadline - CHILD_SLACK)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")}  # hermetic: no user settings
        env["PYTHONUNBUFFERED"] = "1"
        print(f"[{spec.name}] {label} ...", flush=True)
        started = time.time()
        try:
            rc = subprocess.run(cmd, env=env, timeout=remaining, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"[{spec.name}] {label}: exit {rc} after {time.time() - started:.0f} s", flush=True)
        if rc not in (0, RECORDED_ERROR):  # otherwise it died without writing a record: write one
            why = (f"killed at the command deadline ({self.args.deadline:.0f} s)" if rc == "timeout"
                   else f"died with exit status {rc}" + (" (SIGKILL: host memory?)" if rc == -9 else ""))
            self.record(spec, {"kind": "error", "stage": stage, "label": label, "error": why, **which})

    def record(self, spec: wl.Spec, body: dict[str, Any]) -> None:
        append(self.args.out, {"run_id": self.run_id, "command": self.command, "smoke": self.args.smoke,
                               "workload": spec.name, "spec": spec.info(),
                               **wl.environment(spec.device, name_device=False), **body})

    def run(self, spec: wl.Spec, methods: list[str]) -> None:
        lacking = wl.missing(spec)
        if lacking:
            print(f"[{spec.name}] skipped: {', '.join(lacking)} not installed", flush=True)
            self.record(spec, {"kind": "skip", "stage": "workload", "reason": f"{', '.join(lacking)} not installed"})
            return
        cache = os.path.join(tempfile.mkdtemp(prefix="bench-autotune-cache-"), "plans.db")  # cold means empty
        for method in methods:
            module = PEER_MODULES.get(method)
            if module and not wl._installed(module):
                self.record(spec, {"kind": "skip", "stage": "tune", "method": method,
                                   "reason": f"{module} not installed"})
                continue
            self.spawn(spec, "tune", ["--method", method, "--cache", cache], method)
        self.verify_all(spec)

    def verify_all(self, spec: wl.Spec) -> None:
        """One fresh process per distinct answer of this run, unless --known already verified it."""
        mine = [r for r in read([self.args.out]) if r.get("run_id") == self.run_id and r["workload"] == spec.name]
        answers: dict[tuple[str, str, str, int], list[str]] = {}
        first = ("grid", *METHODS)  # the reference first: the ratios need it, should the deadline cut the rest
        for r in sorted(mine, key=lambda r: first.index(r["method"]) if r.get("method") in first else len(first)):
            if r["kind"] == "tune" and r.get("config"):
                answers.setdefault(config_key(r["config"]), []).append(r["method"])
        done = {config_key(r["config"]) for r in read(self.args.known)
                if r.get("kind") == "verify" and r["workload"] == spec.name and r.get("smoke") == self.args.smoke
                and (r.get("train") or {}).get("steps_requested", 0) >= self.args.steps}
        configs = {config_key(r["config"]): r["config"] for r in mine if r["kind"] == "tune" and r.get("config")}
        for key, methods in answers.items():
            if key in done:
                print(f"[{spec.name}] verify {configs[key]['name']} @ {configs[key]['micro_batch_size']}: "
                      "already in --known, skipped", flush=True)
                continue
            self.spawn(spec, "verify", ["--config", json.dumps(configs[key]), "--for-methods", ",".join(methods)],
                       f"verify {configs[key]['name']} micro-batch {configs[key]['micro_batch_size']} "
                       f"(for {', '.join(methods)})")


def main(argv: list[str] | None = None) -> int:
    """`argv`: the arguments after the script's name (default: the command line's)."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", action="append", choices=("W1", "W2", "W3"),
                   help="repeatable; default all three")
    p.add_argument("--methods", default="all", help=f"comma-separated, from: {', '.join(METHODS)}; default all")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps that verify each answer (0: time it only); default 100, 2 with --smoke")
    p.add_argument("--probe-steps", type=int, default=3,
                   help="optimizer steps per peer try (Lightning's steps_per_trial default, 3)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds after which no new process starts and running ones wrap up; "
                        "default 560 on a GPU (the machine's 10-minute limit), none with --smoke")
    p.add_argument("--grid-micro", default="",
                   help="comma-separated micro-batch sizes for the grid (default: powers of 2 up to the global batch)")
    p.add_argument("--known", action="append", default=[],
                   help="earlier result files: configurations verified there with as many steps are not re-run")
    p.add_argument("--smoke", action="store_true", help="tiny CPU stand-ins under the simulated ceiling")
    p.add_argument("--out", default="bench_peers.jsonl")
    # internal: one child process
    p.add_argument("--child", choices=("tune", "verify"), help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--for-methods", default="", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    p.add_argument("--run-id", help=argparse.SUPPRESS)
    p.add_argument("--command", help=argparse.SUPPRESS)
    p.add_argument("--stop-at", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)

    methods = list(METHODS) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    methods = [m for m in METHODS if m in methods]  # cold before warm, whatever order was given
    if args.steps is None:
        args.steps = 2 if args.smoke else 100
    if args.deadline is None and not args.smoke:
        args.deadline = 560.0
    if not args.smoke and not torch.cuda.is_available():
        p.error("no CUDA GPU: run on the GPU machine, or pass --smoke for the CPU stand-ins")
    driver = Driver(args, argv)
    specs = wl.workloads(args.smoke)
    for name in args.workload or ["W1", "W2", "W3"]:
        driver.run(specs[name], methods)

    import render

    mine = [r for r in render.load([args.out]) if r.get("run_id") == driver.run_id]
    print(render.text_summary(mine))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
