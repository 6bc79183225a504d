#!/usr/bin/env bash
# Is a replicated rank slower per sample than one GPU alone, and is it the ranks or the host?
#   AS=0.001@6 bash benchmarks/bench_rank_overhead.sh OUTDIR
# The same configuration (fit's plan changed as AS says, bench_multi_gpu.py --shares form) trained three ways,
# each with its step timed in parts (bench_replicated_parts.py):
#   ranks     two ranks under torchrun, global batch 64 (32 a rank), budget BUDGET per GPU
#   pair      two independent processes at once, one per GPU, global batch 32 each, no process group
#   alone     one process on GPU 0, global batch 32
# pair beside alone: what sharing the host costs; ranks beside pair: what being ranks of one job costs.
# Single processes get BUDGET_SINGLE (their optimizer state is not split over ranks; the cap does not change
# the speed of a configuration that fits). GLOBAL is the ranks' global batch (64), each single process gets half;
# ARGS goes to every run (the CPU check in tests/test_bench_replicated.py: ARGS="--model tiny-gpt --device cpu ...").
set -u
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/data/rank_overhead}
mkdir -p "$OUT"
AS=${AS:-0.001@6} BUDGET=${BUDGET:-16GiB} BUDGET_SINGLE=${BUDGET_SINGLE:-24GiB} STEPS=${STEPS:-10} GLOBAL=${GLOBAL:-64}
HALF=$((GLOBAL / 2)) PY=${PYTHON:-python}
rc=0
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} AUTOTUNE_CACHE=off
P="benchmarks/bench_replicated_parts.py --steps $STEPS --as $AS --variants as-planned,parts,as-planned ${ARGS:-}"
$PY -m torch.distributed.run --standalone --nproc-per-node 2 $P --budget "$BUDGET" --global-batch-size "$GLOBAL" > "$OUT/ranks.txt" 2> "$OUT/ranks.err" || rc=1
CUDA_VISIBLE_DEVICES=0 $PY $P --budget "$BUDGET_SINGLE" --global-batch-size "$HALF" > "$OUT/pair0.txt" 2> "$OUT/pair0.err" &
first=$!
CUDA_VISIBLE_DEVICES=1 $PY $P --budget "$BUDGET_SINGLE" --global-batch-size "$HALF" > "$OUT/pair1.txt" 2> "$OUT/pair1.err" || rc=1
wait $first || rc=1
CUDA_VISIBLE_DEVICES=0 $PY $P --budget "$BUDGET_SINGLE" --global-batch-size "$HALF" > "$OUT/alone.txt" 2> "$OUT/alone.err" || rc=1
for f in ranks pair0 pair1 alone; do echo "== $f"; grep -v '^{' "$OUT/$f.txt"; tail -2 "$OUT/$f.err" | grep -i error || true; done
exit $rc  # 1 when any of the four runs failed
