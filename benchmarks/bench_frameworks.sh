#!/usr/bin/env bash
# Zero-change `autotune run` on the frameworks people use: a LightningCLI script and the Hugging Face
# Trainer script, each tuned through its preset and trained STEPS optimizer steps under a memory ceiling;
# the plan's claimed samples/s beside what the real run measured (the agent's median whole optimizer step).
#
# On the GPU machine (lightning, jsonargparse[signatures], transformers, accelerate installed: pip install -e ".[test]"):
#   bash benchmarks/bench_frameworks.sh                       # both, 20 steps each (up to TIMEOUT=560 s each)
#   ONLY=lightning bash benchmarks/bench_frameworks.sh        # or ONLY=hf: one per call, under 10 minutes
#   TECHNIQUES=bf16,checkpointing,compile bash benchmarks/bench_frameworks.sh   # let the search try --torch_compile
#
# Lightning: the examples' GPT at GPT-2 medium's shape (24 layers, 1024 wide, 16 heads, seq 1024), global batch 32,
# 10 GiB (the issue's case). HF Trainer: GPT-2 large, seq 1024, global batch 64, 24 GiB (W1's shape).
# Compile is left out by default (AUTOTUNE_TECHNIQUES): a compiled trial of GPT-2 large costs minutes.
# Everything lands in $OUTDIR (default benchmarks/out/frameworks-<time>/): <name>.cmd, <name>.json (the plan with
# measured_samples_per_second), <name>.log, and summary.md (the rows for benchmarks/RESULTS.md).
set -euo pipefail
cd "$(dirname "$0")/.."

STEPS=${STEPS:-20}
TRIAL_STEPS=${TRIAL_STEPS:-3}
ONLY=${ONLY:-}
# Each framework's global batch, budget and model flags; override for a quick CPU smoke run, e.g.
#   LIGHTNING="8 8MiB --model.layers 2 --model.width 64" HF="8 24MiB --model_size tiny --seq_len 64 --vocab_size 512" \
#   STEPS=6 bash benchmarks/bench_frameworks.sh
read -r -a LIGHTNING <<< "${LIGHTNING:-32 10GiB --model.layers 24 --model.width 1024 --model.heads 16 --data.seq_len 1024 --data.vocab_size 50257}"
read -r -a HF <<< "${HF:-64 24GiB --model_size gpt2-large --seq_len 1024}"
TIMEOUT=${TIMEOUT:-560}  # seconds per framework, tune + train: one framework per call fits a 10-minute command
export AUTOTUNE_TECHNIQUES=${TECHNIQUES:-bf16,checkpointing}
if command -v autotune >/dev/null 2>&1; then AUTOTUNE=(autotune); else AUTOTUNE=(python -m autotune); fi
out=${OUTDIR:-"benchmarks/out/frameworks-$(date +%Y%m%dT%H%M%S)"}
mkdir -p "$out"
"${AUTOTUNE[@]}" doctor > "$out/doctor.txt" 2>&1 || true

run_one() {  # name, then the `autotune run` arguments
  local name=$1; shift
  local cmd=("${AUTOTUNE[@]}" run --cache off --json --trial-steps "$TRIAL_STEPS" "$@")
  printf '%q ' "${cmd[@]}" > "$out/$name.cmd"; echo >> "$out/$name.cmd"
  echo "== $name: $(cat "$out/$name.cmd")" >&2
  local rc=0
  timeout --signal=TERM --kill-after=30 "$TIMEOUT" "${cmd[@]}" > "$out/$name.json" 2> "$out/$name.log" || rc=$?
  echo "$rc" > "$out/$name.rc"
  tail -n 4 "$out/$name.log" >&2
}

if [ -z "$ONLY" ] || [ "$ONLY" = lightning ]; then
  python -c "import lightning, jsonargparse, docstring_parser" || { echo "needs lightning and jsonargparse[signatures]; on a \
machine without an index: pip install --target gpu_deps 'jsonargparse[signatures]' elsewhere, bring gpu_deps along, \
PYTHONPATH=gpu_deps" >&2; exit 4; }
  run_one lightning --preset lightning-cli --global-batch-size "${LIGHTNING[0]}" --budget "${LIGHTNING[1]}" \
    --map checkpointing=--model.gradient_checkpointing=true \
    examples/train_lightning.py fit --trainer.max_steps "$STEPS" "${LIGHTNING[@]:2}"
fi
if [ -z "$ONLY" ] || [ "$ONLY" = hf ]; then
  python -c "import transformers, accelerate" || { echo "needs transformers and accelerate" >&2; exit 4; }
  run_one hf-trainer --preset hf-trainer --global-batch-size "${HF[0]}" --budget "${HF[1]}" \
    examples/train_hf_trainer.py --max_steps "$STEPS" --logging_steps 10 --disable_tqdm true \
    --output_dir "$out/hf" "${HF[@]:2}"
fi

python - "$out" <<'PY' | tee "$out/summary.md"
import json, os, re, sys
from autotune.plan import Plan
out = sys.argv[1]
print("| script | exit | plan | trials | tune s | s a trial | start-up s a trial | claimed samples/s | "
      "measured samples/s | claimed / measured |")
print("|---|---|---|---|---|---|---|---|---|---|")
for name in ("lightning", "hf-trainer"):
    if not os.path.exists(f"{out}/{name}.rc"):
        continue
    rc = open(f"{out}/{name}.rc").read().strip()
    try:
        plan = Plan.from_dict(json.load(open(f"{out}/{name}.json")))
    except (OSError, ValueError, KeyError, TypeError):
        plan = None
    if plan is None:
        print(f"| {name} | {rc} | no plan (see {name}.log) | | | | | | | |")
        continue
    shape = f"{plan.rung.name}, micro-batch {plan.micro_batch_size} x {plan.accumulation_steps}"
    forked = re.search(r"imported torch[^(]* once \(([\d.]+) s\)", plan.reason or "")
    tune_s = sum(t.seconds for t in plan.trials) + (float(forked[1]) if forked else 0.0)  # with the fork server's start
    start = re.search(r"trials: start-up ([\d.]+) s of ([\d.]+) s each", plan.reason or "")
    claimed, measured = plan.samples_per_second, plan.measured_samples_per_second
    ratio = f"{claimed / measured:.2f}" if measured else "not measured"
    print(f"| {name} | {rc} | {shape} | {len(plan.trials)} | {tune_s:.0f} | {tune_s / max(1, len(plan.trials)):.1f} | "
          f"{start[1] if start else '-'} | {claimed:,.1f} | {measured and f'{measured:,.1f}' or '-'} | {ratio} |")
print()
doctor = open(f"{out}/doctor.txt").read().splitlines() if os.path.exists(f"{out}/doctor.txt") else []
for line in doctor:  # which GPU and torch produced the rows
    if line.startswith(("GPU", "torch")):
        print(f"    {line}")
PY
