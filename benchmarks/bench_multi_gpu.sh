#!/usr/bin/env bash
# Several GPUs of one host in one call: replicated beside one GPU, sharded, and what the links cost.
#   bash benchmarks/bench_multi_gpu.sh [OUT.jsonl]
#   CASES="xl large" bash benchmarks/bench_multi_gpu.sh     # some of them (a call is limited in time)
#   CASES="single replicated@4 xl xl@4" bash benchmarks/bench_multi_gpu.sh   # CASE@N: on N ranks (default 2)
# single      replicated GPT-2 medium at 16 GiB, global batch 64, on one GPU (the baseline)
# replicated  the same on two GPUs: the scaling is its tokens/s over single's; then the same plan again with the
#             gradient all-reduce the other way from fit's choice (plan.reduce_overlap), same process: the choice's gain
# xl          GPT-2 XL at 16 GiB per GPU handed to fit unsharded: the plan must shard it; then STEPS steps
# unpartitioned  replicated with every rank stepping every parameter's optimizer offload (beside 'replicated': what
#             partitioning it over the ranks gained; techniques/offload_partition.py)
# nooverlap   replicated with one bucket of 100 GB: the all-reduce starts when backward ends (not run by default;
#             beside 'replicated' it is the overlap's gain)
# link        what one step's gradient all-reduce of GPT-2 medium costs here (FP32 and BF16, per parameter and
#             flat), with `nvidia-smi topo -m`: whether the GPUs talk over NVLink or PCIe
# large       GPT-2 large sharded before fit at 10 GiB per GPU: fit, then every rung at micro-batch 1 with its peak
# xlpeak      GPT-2 XL sharded before fit at 16 GiB per GPU, every rung with its peak broken down by what allocated it
#             (peak_breakdown.py), AdamW named foreach (torch's default on CUDA), then left unset, which autotune
#             steps fused on shards (FORMS="foreach default"); RUNGS="bf16+full ckpt" measures only those rungs;
#             each rung's peak by phase of the step, or BREAKDOWN=trace by what allocated it
# Each line of OUT is one JSON result (benchmarks/data/multi_gpu.jsonl by default); a case that fails
# records its error and the next one still runs.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/data/multi_gpu.jsonl}
STEPS=${STEPS:-20}
CASES=${CASES:-single replicated xl large}
CASE_S=${CASE_S:-0}  # a time limit per case in seconds (0: none): one slow case cannot eat a whole call; S_xl=170 sets one
# SHARES="0.3,0.01": single and replicated also train their plan again at each of these host shares (same process);
# SHARES_single / SHARES_replicated: for one of them only (bench_multi_gpu.py --shares says the form)
# TRIALS_replicated="0@16@k16,z@16@k10": replicated also puts these variants through the trial runner, then trains them
SHARES_single=${SHARES_single:-${SHARES:-}} SHARES_replicated=${SHARES_replicated:-${SHARES:-}}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} AUTOTUNE_CACHE=off
B=benchmarks/bench_multi_gpu.py
first=${CUDA_VISIBLE_DEVICES:-0}; first=${first%%,*}  # single's GPU: the first of those this run may use
echo "# $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null) cases: $CASES" >&2
for item in $CASES; do
  case=${item%@*}; ranks=2; [ "$item" != "$case" ] && ranks=${item#*@}  # "xl@4": the case on 4 ranks
  v="S_$case"; lim=${!v:-$CASE_S}
  LIMIT=(); [ "$lim" -gt 0 ] && LIMIT=(timeout --signal=INT --kill-after=15 "$lim")
  TR="${LIMIT[*]} torchrun --standalone --nproc-per-node $ranks"
  case $case in
    single) CUDA_VISIBLE_DEVICES=$first ${LIMIT[*]} python $B --case replicated --model gpt2-medium --budget 16GiB --steps "$STEPS" ${SHARES_single:+--shares "$SHARES_single"} --out "$OUT" ;;
    replicated) $TR $B --case replicated --model gpt2-medium --budget 16GiB --steps "$STEPS" --compare-reduce ${SHARES_replicated:+--shares "$SHARES_replicated"} ${TRIALS_replicated:+--trials "$TRIALS_replicated"} --out "$OUT" ;;
    unpartitioned) AUTOTUNE_OFFLOAD_PARTITION=0 $TR $B --case replicated --model gpt2-medium --budget 16GiB --steps "$STEPS" --out "$OUT" ;;
    link) nvidia-smi topo -m >&2; $TR $B --case link --model gpt2-medium --out "$OUT" ;;
    nooverlap) $TR $B --case replicated --model gpt2-medium --budget 16GiB --steps "$STEPS" --bucket-mb 100000 --out "$OUT" ;;
    xl) $TR $B --case needs-sharding --model gpt2-xl --budget 16GiB --steps "$STEPS" --out "$OUT" ;;
    # Global batch 16 and 2 steps a rung: at micro-batch 1 a rung's step is per-rank-batch forwards and backwards
    # (at 64 the five rungs did not finish in 150 s on two H200s after fit).
    large) $TR $B --case presharded --model gpt2-large --budget 10GiB --global-batch-size 16 --rung-steps 2 --out "$OUT" ;;
    xlpeak) for form in ${FORMS:-foreach default}; do
              $TR $B --case presharded --model gpt2-xl --budget 16GiB --global-batch-size 16 --rung-steps 2 --breakdown "${BREAKDOWN:-phases}" --optimizer-form "$form" ${RUNGS:+--rungs "$RUNGS"} --out "$OUT"
            done ;;
    *) echo "unknown case $case (single, replicated, unpartitioned, nooverlap, link, xl, large, xlpeak)" >&2; exit 2 ;;
  esac
  echo "# case $item exit $?" >&2
done
