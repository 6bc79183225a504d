#!/usr/bin/env bash
# gpu_session.sh runs side by side on a host of several GPUs, one stream per GPU, so one 10-minute call does
# that many single-GPU calls' work. Each stream gets its own GPU, an equal share of the host's cores (taskset:
# optimizer offload steps AdamW on the host, and streams must not share cores), and its own Inductor and
# Triton caches (a compile cache warmed by another stream would make a cold fit warm). Ratios are read within a
# stream only. STREAMn names stream n's parts; the streams are those set, up to the GPUs there are.
#
#   STREAM0="grid w3" STREAM1="w1cold w1warm frameworks" bash benchmarks/gpu_streams.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/streams-$(date +%Y%m%dT%H%M%S)}
gpus=$(nvidia-smi --list-gpus | wc -l)
streams=()
for ((i = 0; i < gpus; i++)); do
    var="STREAM$i"
    [ -n "${!var:-}" ] && streams+=("$i")
done
share=$(( $(nproc) / ${#streams[@]} ))
stream() {  # GPU index, parts, position among the streams (which cores)
    local i=$1 parts=$2 first=$(( $3 * share ))
    mkdir -p "$OUT/gpu$i"
    CUDA_VISIBLE_DEVICES=$i OMP_NUM_THREADS=$share PARTS="$parts" OUT="$OUT/gpu$i" \
        TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-gpu$i TRITON_CACHE_DIR=/tmp/triton-gpu$i \
        taskset -c "$first-$((first + share - 1))" bash benchmarks/gpu_session.sh > "$OUT/gpu$i/session.log" 2>&1
}
for n in "${!streams[@]}"; do
    i=${streams[$n]} var="STREAM${streams[$n]}"
    stream "$i" "${!var}" "$n" &
done
wait
for i in "${streams[@]}"; do echo "=== GPU $i: ${OUT}/gpu$i"; sed -n '/^== summary/,$p' "$OUT/gpu$i/session.log"; done
