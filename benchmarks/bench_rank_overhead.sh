#!/usr/bin/env bash
# Issue 16: is a replicated rank slower per sample than one GPU alone, and is it the ranks or the host?
#   AS=0.001@6 bash benchmarks/bench_rank_overhead.sh OUTDIR
# The same configuration (fit's plan changed as AS says, bench_multi_gpu.py --shares form) trained three ways,
# each with its step timed in parts (bench_replicated_parts.py):
#   ranks     two ranks under torchrun, global batch 64 (32 a rank), budget BUDGET per GPU
#   pair      two independent processes at once, one per GPU, global batch 32 each, no process group
#   alone     one process on GPU 0, global batch 32
# pair beside alone: what sharing the host costs; ranks beside pair: what being ranks of one job costs.
# Single processes get BUDGET_SINGLE (their optimizer state is not split over ranks; the cap does not change
# the speed of a configuration that fits).
set -u
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/data/rank_overhead}
mkdir -p "$OUT"
AS=${AS:-0.001@6} BUDGET=${BUDGET:-16GiB} BUDGET_SINGLE=${BUDGET_SINGLE:-24GiB} STEPS=${STEPS:-10}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} AUTOTUNE_CACHE=off
P="benchmarks/bench_replicated_parts.py --steps $STEPS --as $AS --variants as-planned,parts,as-planned"
torchrun --standalone --nproc-per-node 2 $P --budget "$BUDGET" > "$OUT/ranks.txt" 2> "$OUT/ranks.err"
CUDA_VISIBLE_DEVICES=0 python $P --budget "$BUDGET_SINGLE" --global-batch-size 32 > "$OUT/pair0.txt" 2> "$OUT/pair0.err" &
CUDA_VISIBLE_DEVICES=1 python $P --budget "$BUDGET_SINGLE" --global-batch-size 32 > "$OUT/pair1.txt" 2> "$OUT/pair1.err"
wait
CUDA_VISIBLE_DEVICES=0 python $P --budget "$BUDGET_SINGLE" --global-batch-size 32 > "$OUT/alone.txt" 2> "$OUT/alone.err"
for f in ranks pair0 pair1 alone; do echo "== $f"; grep -v '^{' "$OUT/$f.txt"; tail -2 "$OUT/$f.err" | grep -i error; done
