#!/usr/bin/env bash
# gpu_session.sh runs side by side on a host of several GPUs, one stream per GPU, so one 10-minute call does
# that many single-GPU calls' work. Each stream gets its own GPU, an equal share of the host's cores (taskset:
# optimizer offload steps AdamW on the host, and streams must not share cores), and its own Inductor and
# Triton caches (a compile cache warmed by another stream would make a cold fit warm). Ratios are read within a
# stream only. STREAMn names stream n's parts; the streams are those set, up to the GPUs there are.
# The streams write under a work folder; $OUT receives two files, streams.tgz (every log and JSON line) and
# summary.txt (what is printed last), since a GPU machine's $OUT gives back only a few files.
#
#   STREAM0="grid w3" STREAM1="w1cold w1warm frameworks" bash benchmarks/gpu_streams.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/streams-$(date +%Y%m%dT%H%M%S)}
WORK=$(mktemp -d /tmp/streams-XXXX)
mkdir -p "$OUT"
gpus=$(nvidia-smi --list-gpus | wc -l)
streams=()
for ((i = 0; i < gpus; i++)); do
    var="STREAM$i"
    [ -n "${!var:-}" ] && streams+=("$i")
done
share=$(( $(nproc) / ${#streams[@]} ))
stream() {  # GPU index, parts, position among the streams (which cores)
    local i=$1 parts=$2 first=$(( $3 * share ))
    mkdir -p "$WORK/gpu$i"
    CUDA_VISIBLE_DEVICES=$i OMP_NUM_THREADS=$share PARTS="$parts" OUT="$WORK/gpu$i" \
        TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-gpu$i TRITON_CACHE_DIR=/tmp/triton-gpu$i \
        taskset -c "$first-$((first + share - 1))" bash benchmarks/gpu_session.sh > "$WORK/gpu$i/session.log" 2>&1
}
for n in "${!streams[@]}"; do
    i=${streams[$n]} var="STREAM${streams[$n]}"
    stream "$i" "${!var}" "$n" &
done
wait
for i in "${streams[@]}"; do echo "=== GPU $i"; sed -n '/^== summary/,$p' "$WORK/gpu$i/session.log"; done \
    | tee "$OUT/summary.txt"
tar czf "$OUT/streams.tgz" -C "$WORK" .
