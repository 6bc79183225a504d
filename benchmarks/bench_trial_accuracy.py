"""How well a trial predicts training, under optimizer offload: the search ranks by trial
estimates, so an estimate that is off for one kind of configuration biases the pick.

For one configuration (`--config BLOCKS,MICRO`, optimizer offload of every parameter, `--compile`), in one
process: the trial runner's estimate with each measured step's backward overlapped (the host optimizer
stepping during it), the estimate with serial measured steps (the optimizer after backward, as for every
micro-batch but the last in training, which is what the search measures), then `--steps` training steps
through `plan.apply` with the overlapped and the serial optimizer offload. Printed: the four tokens/s figures.

    python benchmarks/bench_trial_accuracy.py --workload M16 --config 0,8 --compile --out acc.jsonl
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_offload import config_parser, run_mode, set_up
from workloads import environment

from autotune.devices.placement import resolve_device
from autotune.plan import Plan
from autotune.search.trial import TrialRunner, Workload
from autotune.sizes import parse_bytes
from autotune.techniques import find_blocks
from autotune.workload import batch as batches
from autotune.workload.losses import resolve
from autotune.workload.optimizers import OptimizerSpec


def trial_estimate(work: Workload, plan: Plan, overlapped: bool) -> float:
    """The runner's samples/s for `plan`'s configuration, its measured steps overlapped or serial (the search
    measures serial steps; `fit` runs one overlapped trial of its pick to choose `plan.offload_overlap`)."""
    trial = TrialRunner(work)(plan.rung, plan.micro_batch_size, offload_fraction=plan.offload_fraction,
                              overlap=overlapped)
    print(f"  trial overlapped={overlapped}: {trial.outcome}, step {trial.step_seconds:.4f} s, optimizer "
          f"{trial.optimizer_seconds:.4f} s, peak {trial.peak_bytes / 2**30:.2f} GiB", flush=True)
    return trial.samples_per_second if trial.fits else 0.0


def main() -> None:
    args = config_parser(__doc__, workload="M16", config="0,8", steps=8, warmup=2).parse_args()
    setup = set_up(args)
    seq, budget, device, model = setup.seq, setup.budget, setup.device, setup.model
    plan = setup.plan(args)
    work = Workload(model=model, batch=setup.example, loss_fn=resolve(None), spec=OptimizerSpec.from_user(None, model),
                    placement=resolve_device(device), budget_bytes=parse_bytes(budget),
                    limit_bytes=int(0.9 * parse_bytes(budget)), per_rank=plan.global_batch_size,
                    blocks=find_blocks(model))
    print(f"{args.workload}: {plan.rung.name} at micro-batch {plan.micro_batch_size} x {plan.accumulation_steps}",
          flush=True)
    row = {"workload": args.workload, "config": args.config, "compile": args.compile}
    for overlapped in (True, False):
        row[f"estimate_armed_{overlapped}"] = trial_estimate(work, plan, overlapped) * seq
    batch = batches.resize(setup.example, plan.global_batch_size)
    for mode in ("overlap", "serial"):
        row[f"trained_{mode}"] = run_mode(mode, plan, model, batch, args, device, seq)["tok_s"]
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print("  tok/s: estimate armed {estimate_armed_True:,.0f}, unarmed {estimate_armed_False:,.0f}; trained "
          "overlapped {trained_overlap:,.0f}, serial {trained_serial:,.0f}".format(**row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({**row, **environment(device)}) + "\n")


if __name__ == "__main__":
    main()
