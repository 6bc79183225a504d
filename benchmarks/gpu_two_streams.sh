#!/usr/bin/env bash
# Two gpu_session.sh runs side by side on a 2-GPU machine, one per GPU, so one 10-minute call does twice the
# single-GPU work. Each stream gets its own GPU, half the host's cores (taskset: optimizer offload steps AdamW
# on the host, and two streams must not share cores), and its own Inductor and Triton caches (a compile
# cache warmed by the other stream would make a cold fit warm). Ratios are read within a stream only.
#
#   STREAM0="grid w3" STREAM1="w1cold w1warm frameworks" bash benchmarks/gpu_two_streams.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/streams-$(date +%Y%m%dT%H%M%S)}
cores=$(nproc); half=$((cores / 2))
stream() {  # index, parts
    local i=$1 parts=$2 first=$(( $1 * half ))
    mkdir -p "$OUT/gpu$i"
    CUDA_VISIBLE_DEVICES=$i OMP_NUM_THREADS=$half PARTS="$parts" OUT="$OUT/gpu$i" \
        TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-gpu$i TRITON_CACHE_DIR=/tmp/triton-gpu$i \
        taskset -c "$first-$((first + half - 1))" bash benchmarks/gpu_session.sh > "$OUT/gpu$i/session.log" 2>&1
}
stream 0 "${STREAM0:-grid w3}" &
stream 1 "${STREAM1:-w1cold w1warm frameworks}" &
wait
for i in 0 1; do echo "=== GPU $i: ${OUT}/gpu$i"; sed -n '/^== summary/,$p' "$OUT/gpu$i/session.log"; done
