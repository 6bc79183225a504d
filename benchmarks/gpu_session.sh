#!/usr/bin/env bash
# One GPU call, several measurements in priority order, each under its own time limit, logs under $OUT.
# A part that runs out of time is cut, and the next one still runs; a table of what finished prints last.
#
#   PARTS="w1cold w1warm" bash benchmarks/gpu_session.sh     # on the GPU machine, after installing the wheels
#
# Parts:
#   w1cold   issue 11: W1 (GPT-2 large, 24 GiB) fit with a cold Inductor cache, then 20 steps of the plan
#   w1warm   issue 11: the same fit again with the compile cache warm (no training)
#   offload  issue 12: benchmarks/bench_offload.py (serial vs overlapped optimizer offload on W1, W2 tok/s)
#   frameworks  issue 13: benchmarks/bench_frameworks.sh (Lightning and HF Trainer under autotune run)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/session-$(date +%Y%m%dT%H%M%S)}
mkdir -p "$OUT"
PARTS=${PARTS:-"w1cold w1warm offload frameworks"}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-w1}
declare -A LIMIT=([w1cold]=${W1COLD_S:-240} [w1warm]=${W1WARM_S:-120} [offload]=${OFFLOAD_S:-150} [frameworks]=${FRAMEWORKS_S:-150})

part() {  # name, then the command
    local name=$1; shift
    local t0=$SECONDS
    timeout --signal=INT --kill-after=10 "${LIMIT[$name]:-120}" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
for p in $PARTS; do
    case $p in
        w1cold) part w1cold env TORCH_LOGS=recompiles python benchmarks/bench_lattice.py --method fit --steps 20 --out "$OUT/w1.jsonl" ;;
        w1warm) part w1warm python benchmarks/bench_lattice.py --method fit --steps 0 --out "$OUT/w1.jsonl" ;;
        offload) part offload bash -c "python benchmarks/bench_offload.py --workload W1 --config 0,8 --compile --steps 6 --out $OUT/offload.jsonl; python benchmarks/bench_offload.py --workload W2 --config 48,8 --steps 4 --out $OUT/offload.jsonl" ;;
        frameworks) part frameworks env OUTDIR="$OUT/frameworks" ONLY="${FRAMEWORKS_ONLY:-}" STEPS=20 TIMEOUT="${LIMIT[frameworks]}" bash benchmarks/bench_frameworks.sh ;;
    esac
done
echo "== summary"; cat "$OUT/gpu.txt" "$OUT/summary.txt"
grep -h "^fit:\|^train \|Recompiling" "$OUT"/w1*.log 2>/dev/null | cut -c1-220 | head -12
grep -h "step .*tail\|tail cut\|^W[12]" "$OUT"/offload.log 2>/dev/null | cut -c1-200
grep -h "^|" "$OUT"/frameworks/summary.md 2>/dev/null
