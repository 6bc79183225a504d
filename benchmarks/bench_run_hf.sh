#!/usr/bin/env bash
# `autotune run` in zero-change mode on an unmodified Hugging Face Trainer script, under a memory ceiling.
#
# On the GPU machine (with transformers and accelerate installed):
#   bash benchmarks/bench_run_hf.sh                         # GPT-2 large, seq 1024, global batch 64, 24 GiB
#   MODEL=gpt2-xl BUDGET=16GiB bash benchmarks/bench_run_hf.sh
#   COMPARE=0 bash benchmarks/bench_run_hf.sh               # skip the HF auto_find_batch_size comparison
#
# The ceiling is applied inside the job by autotune's agent with torch.cuda.set_per_process_memory_fraction
# (BUDGET / the card's memory), in every trial and in the real run; the comparison runs the same script
# through the same agent with HF's own --auto_find_batch_size, under the same ceiling.
# Everything lands in $OUTDIR, by default benchmarks/out/run_hf-<model>-<budget>-<time>/: command.txt, doctor.txt, plan.json
# (autotune's plan), run.log (progress, trials, the real run), hf_auto.log, and summary.txt with the
# figures for benchmarks/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-gpt2-large}
SEQ=${SEQ:-1024}
GLOBAL=${GLOBAL:-64}
BUDGET=${BUDGET:-24GiB}
STEPS=${STEPS:-30}
TRIAL_STEPS=${TRIAL_STEPS:-3}
COMPARE=${COMPARE:-1}
read -r -a EXTRA <<< "${EXTRA:-}"  # more script flags, e.g. EXTRA="--vocab_size 512" for a quick smoke run

python -c "import transformers, accelerate" 2>/dev/null || { echo "needs transformers and accelerate" >&2; exit 4; }
# The console script when autotune is installed; the module from a checkout on PYTHONPATH otherwise.
if command -v autotune >/dev/null 2>&1; then AUTOTUNE=(autotune); else AUTOTUNE=(python -m autotune); fi
out=${OUTDIR:-"benchmarks/out/run_hf-$MODEL-$BUDGET-$(date +%Y%m%dT%H%M%S)"}
mkdir -p "$out"
"${AUTOTUNE[@]}" doctor > "$out/doctor.txt" 2>&1 || true
script_args=(--model_size "$MODEL" --seq_len "$SEQ" --max_steps "$STEPS" --logging_steps 10 --disable_tqdm true
             --output_dir "$out/hf" "${EXTRA[@]}")
cmd=("${AUTOTUNE[@]}" run --global-batch-size "$GLOBAL" --budget "$BUDGET" --trial-steps "$TRIAL_STEPS" --cache off --json
     --map micro_batch=--per_device_train_batch_size --map accumulation=--gradient_accumulation_steps
     --map checkpointing=--gradient_checkpointing --map bf16=--bf16
     examples/train_hf_trainer.py "${script_args[@]}")
printf '%q ' "${cmd[@]}" > "$out/command.txt"
echo >> "$out/command.txt"

# A stop signal (a `timeout`, Ctrl-C) goes on to the running step, which stops its own process group, and the
# summary of what ran is still written. Each step runs in the background: bash runs a trap only between
# commands, and `wait` is the one it can interrupt.
stopped=""
child=""
on_stop() { stopped=$1; [ -z "$child" ] || kill -TERM "$child" 2>/dev/null || true; }
trap 'on_stop TERM' TERM
trap 'on_stop INT' INT
run_step() {
  "$@" &
  child=$!
  local status=0
  wait "$child" || status=$?
  while kill -0 "$child" 2>/dev/null; do  # a signal ended `wait`, not the step: wait for it to stop
    status=0; wait "$child" || status=$?
  done
  child=""
  return "$status"
}

started=$(date +%s)
set +e
# tee ignores the stop signals (a `timeout` signals the whole group): it must outlive the supervisor's last
# words, or they go to a broken pipe and the supervisor exits 1 instead of 143. It ends when they close.
run_step "${cmd[@]}" > "$out/plan.json" 2> >(trap '' TERM INT; exec tee "$out/run.log" >&2)
rc=$?
set -e
seconds=$(( $(date +%s) - started ))

if [ -n "$stopped" ]; then
  hf_rc="not run (stopped by SIG$stopped)"; hf_seconds=0
elif [ "$COMPARE" = 1 ]; then
  # HF's own finder: starts at the global batch per device and halves it on OOM, with accumulation 1.
  python - "$BUDGET" > "$out/budget_bytes" <<'PY'
import sys
from autotune.sizes import parse_bytes
print(parse_bytes(sys.argv[1]))
PY
  echo "+ AUTOTUNE_AGENT_BUDGET=$(cat "$out/budget_bytes") python -m autotune.supervisor.bootstrap examples/train_hf_trainer.py --auto_find_batch_size --per_device_train_batch_size $GLOBAL --bf16 ..." > "$out/hf_auto.log"
  set +e
  hf_started=$(date +%s)
  AUTOTUNE_AGENT_DEVICE=cuda AUTOTUNE_AGENT_BUDGET=$(cat "$out/budget_bytes") \
    run_step python -m autotune.supervisor.bootstrap examples/train_hf_trainer.py "${script_args[@]}" --output_dir "$out/hf_auto" \
    --auto_find_batch_size --per_device_train_batch_size "$GLOBAL" --bf16 >> "$out/hf_auto.log" 2>&1
  hf_rc=$?
  hf_seconds=$(( $(date +%s) - hf_started ))
  set -e
else
  hf_rc=skipped; hf_seconds=0
fi

python - "$out" "$rc" "$seconds" "$hf_rc" "$hf_seconds" <<'PY' | tee "$out/summary.txt"
import json, re, sys
out, rc, seconds, hf_rc, hf_seconds = sys.argv[1:]
print(f"command: {open(f'{out}/command.txt').read().strip()}")
print(f"autotune run: exit {rc}, {seconds} s in all (tuning + real run)")
try:
    plan = json.load(open(f"{out}/plan.json"))
except (OSError, ValueError):
    plan = None
if plan:
    tuning = sum(t["seconds"] for t in plan["trials"])
    print(f"plan: {plan['precision']}, checkpointing {plan['checkpointing']}, micro-batch {plan['micro_batch_size']} x "
          f"{plan['accumulation_steps']} accumulation = {plan['global_batch_size']}; peak "
          f"{plan['peak_memory_bytes'] / 2**30:.2f} of {plan['memory_budget_bytes'] / 2**30:.2f} GiB; "
          f"{plan['samples_per_second']:.2f} samples/s in trials")
    print(f"why: {plan['reason']}")
    print(f"trials: {len(plan['trials'])}, {tuning:.0f} s")
    for t in plan["trials"]:
        rung = t["rung"]["precision"] + ("+ckpt" if t["rung"]["checkpointing"] != "none" else "")
        print(f"  {rung:10} micro {t['micro_batch_size']:3d}  {t['outcome']:11} peak {t['peak_bytes'] / 2**30:6.2f} GiB  "
              f"{t['samples_per_second']:8.2f} samples/s")
log = open(f"{out}/run.log").read()
for pattern in (r"trained \d+ steps in .* tokens/s", r"ended: .*"):
    for line in re.findall(pattern, log):
        print(f"real run: {line}")
if hf_rc == "skipped" or hf_rc.startswith("not run"):
    print(f"HF auto_find_batch_size: {hf_rc}")
else:
    hf = open(f"{out}/hf_auto.log").read()
    print(f"HF auto_find_batch_size: exit {hf_rc}, {hf_seconds} s; "
          + "; ".join(re.findall(r"trained \d+ steps in .* tokens/s", hf) or ["no result"]))
PY
exit "$rc"
