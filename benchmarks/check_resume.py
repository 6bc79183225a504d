"""A checkpoint saved mid-training and resumed in a new process ends bitwise equal to the uninterrupted run.

For each plan variant: `whole` trains STEPS global steps through `plan.apply`, saving `model.state_dict()` and
`optimizer.state_dict()` and the random streams (dropout's) after SAVED_AT of them, as a training script does; `again`
repeats it (the reference's own reproducibility: a kernel that is not deterministic shows there, not as a resume error);
`resume` starts a new process from the checkpoint, loading it before or after `plan.apply`, and trains the
rest. Each phase is its own process, run under `torch.use_deterministic_algorithms`. The final FP32 weights
are compared tensor by tensor.

    python benchmarks/check_resume.py --out /tmp/resume                 # W1 on CUDA, 24 GiB
    python benchmarks/check_resume.py --smoke --out /tmp/resume         # a tiny GPT on the CPU

Prints one line per variant: tensors differing from the uninterrupted run, and the largest difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))

STEPS, SAVED_AT = 6, 3
# name -> plan fields beside bf16 precision; each is one of the optimizer-offload plans fit picks for W1.
VARIANTS = {
    "offload": dict(offload="optimizer", micro_batch_size=4),
    "offload-serial": dict(offload="optimizer", micro_batch_size=4, offload_overlap=False),
    "offload-half-ckpt": dict(offload="optimizer", offload_fraction=0.5, checkpointing="full", micro_batch_size=8),
    "offload-compile": dict(offload="optimizer", micro_batch_size=4, compile=True),
}


def _plan(variant: str, spec, device: str):
    from autotune.plan import Plan
    from autotune.sizes import parse_bytes
    from autotune.workload.batching import solve_accumulation

    fields = dict(VARIANTS[variant])
    micro = fields.pop("micro_batch_size")
    micro = micro if device.startswith("cuda") else 2
    steps, last = solve_accumulation(spec.global_batch_size, micro)
    return Plan.of(precision="bf16", **{"checkpointing": "none", **fields}, micro_batch_size=micro,
                accumulation_steps=steps, world_size=1, global_batch_size=spec.global_batch_size,
                last_micro_batch_size=last, peak_memory_bytes=0, memory_budget_bytes=parse_bytes(spec.budget),
                margin=0.1, samples_per_second=0.0, device="cuda" if device.startswith("cuda") else "cpu")


def _batch(k: int, spec, vocab: int, device: str):
    import torch

    g = torch.Generator().manual_seed(1000 + k)
    ids = torch.randint(0, vocab, (spec.global_batch_size, spec.seq), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


def _host() -> dict:
    import psutil

    vm = psutil.virtual_memory()
    return {"rss_gib": psutil.Process().memory_info().rss / 2**30, "available_gib": vm.available / 2**30,
            "total_gib": vm.total / 2**30}


def _rng() -> dict:
    import torch

    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def _set_rng(state: dict) -> None:
    import torch

    torch.set_rng_state(state["cpu"].cpu())  # ByteTensors on the CPU, wherever map_location put them
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu())


def phase(args) -> None:
    """One process: `whole`/`again` (train, checkpoint at SAVED_AT) or `resume-before`/`resume-after`."""
    import torch

    torch.use_deterministic_algorithms(True)
    sys.path.insert(0, _HERE)
    import workloads

    spec = workloads.workloads(args.smoke)["W1"]
    device = spec.device
    workloads.cap_memory(device, spec.budget)
    model, _, _ = workloads.build(spec, device)
    vocab = next(m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding))  # tokens first
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1)  # a small lr: 16-bit rounding shows
    plan = _plan(args.variant, spec, device)
    ckpt = os.path.join(args.out, f"{args.variant}.ckpt.pt")
    resuming = args.phase.startswith("resume")
    first = SAVED_AT if resuming else 0
    if args.phase == "resume-before":
        saved = torch.load(ckpt, map_location=device)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    step = plan.apply(model, opt)
    if args.phase == "resume-after":
        saved = torch.load(ckpt, map_location="cpu")  # after apply, the optimizer state goes to the host
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    if resuming:
        _set_rng(saved["rng"])  # dropout's streams, as a training script saves them beside the weights
        del saved
    started = time.perf_counter()
    for k in range(first, STEPS):
        if k == SAVED_AT and args.phase == "whole":
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": _rng()}
            dtypes = sorted({str(v.dtype) for v in state["model"].values()})
            torch.save(state, ckpt)
            del state
        step(_batch(k, spec, vocab, device))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_reserved() / 2**30 if device.startswith("cuda") else 0.0
    step.close()
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()},
               os.path.join(args.out, f"{args.variant}.{args.phase}.pt"))
    report = {"variant": args.variant, "phase": args.phase, "steps": STEPS - first, "seconds": seconds,
              "gpu_reserved_gib": peak, **_host()}
    if args.phase == "whole":
        report["checkpoint_dtypes"] = dtypes
    print(json.dumps(report), flush=True)


def compare(out: str, variant: str, phase_name: str) -> tuple[int, int, float]:
    import torch

    want = torch.load(os.path.join(out, f"{variant}.whole.pt"))
    got = torch.load(os.path.join(out, f"{variant}.{phase_name}.pt"))
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    largest = max((float((want[k].double() - got[k].double()).abs().max()) for k in differ), default=0.0)
    return len(differ), len(want), largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for checkpoints (removed after each variant) and the log")
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT on the CPU instead of W1")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument("--phases", default="whole,again,resume-before,resume-after",
                        help="which phases to run, in order (whole first: it writes the checkpoint)")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        phase(args)
        return
    os.makedirs(args.out, exist_ok=True)
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "AUTOTUNE_CACHE": "off"}
    rows = []
    for variant in args.variants.split(","):
        for name in args.phases.split(","):
            cmd = [sys.executable, __file__, "--out", args.out, "--variant", variant, "--phase", name]
            cmd += ["--smoke"] if args.smoke else []
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            with open(os.path.join(args.out, "log.txt"), "a") as log:
                log.write(f"$ {' '.join(cmd)}\n{done.stdout}{done.stderr[-4000:]}\n")
            if done.returncode != 0:
                print(f"{variant} {name}: exit {done.returncode}; see {args.out}/log.txt", flush=True)
                break
            report = json.loads(done.stdout.strip().splitlines()[-1])
            if name != "whole":
                report["differ"], report["tensors"], report["largest"] = compare(args.out, variant, name)
            rows.append(report)
            print(json.dumps(report), flush=True)
        for name in os.listdir(args.out):  # W1's checkpoint is 9 GB: keep only the log
            if name.startswith(f"{variant}.") and name.endswith(".pt"):
                os.remove(os.path.join(args.out, name))
    print(f"\n{'variant':<18} {'phase':<14} {'differ':>9} {'largest':>9} {'s/step':>7} {'GPU GiB':>8} {'RSS GiB':>8}")
    for r in rows:
        differ = f"{r['differ']}/{r['tensors']}" if "differ" in r else "-"
        largest = f"{r['largest']:.1e}" if "largest" in r else "-"
        print(f"{r['variant']:<18} {r['phase']:<14} {differ:>9} {largest:>9} {r['seconds'] / r['steps']:>7.2f} "
              f"{r['gpu_reserved_gib']:>8.2f} {r['rss_gib']:>8.2f}")


if __name__ == "__main__":
    main()
