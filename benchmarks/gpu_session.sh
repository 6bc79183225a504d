#!/usr/bin/env bash
# One GPU call, several measurements in priority order, each under its own time limit, logs under $OUT.
# A part that runs out of time is cut, and the next one still runs; a table of what finished prints last.
#
#   PARTS="w1cold w1warm" bash benchmarks/gpu_session.sh     # on the GPU machine, after installing the wheels
#
# Parts:
#   w1cold   W1 (GPT-2 large, 24 GiB) fit with a cold Inductor cache, then 20 steps of the plan
#   w1warm   the same fit again with the compile cache warm (no training)
#   offload  benchmarks/bench_offload.py (serial vs overlapped optimizer offload on W1, W2 tok/s)
#   frameworks  benchmarks/bench_frameworks.sh (Lightning and HF Trainer under autotune run)
#   grid     the expert grid on W1 (compile x blocks recomputed {0, N/2, N} x offload), its best trained
#   w2       W2 (GPT-2 XL, 16 GiB) autotune.fit cold, then 20 steps (bench_peers)
#   w3       W3 (ResNet-152, 12 GiB) the peers' grid and autotune.fit cold, 30 steps each (bench_peers)
#   blocks   benchmarks/bench_blocks.py on W3's ResNet-152 (which blocks to recompute)
#   ckpt     W2 at full recompute + optimizer offload, 8 x 8, compiled per block, then eager
#   moe      benchmarks/bench_moe.py (a Mixtral-style MoE's router loss over micro-batches, 20 steps)
#   llama3b  a 3B Llama-shaped decoder at 24 GiB, global batch 32, 20 steps (bench_llama.py)
#   llama1b  a 1.1B Llama (TinyLlama's shape) at 24 GiB, sequence 2048: plan.mfu, 5 steps (bench_llama.py)
#   llama8b  the 8B decoder at 76 GiB, global batch 64, 10 steps: its tune alone takes about 9
#            minutes, over one call's 10; start it with setsid and collect it in a second call
#   lengths  GPT-2 medium at 10 GiB over padded lengths 256-1024, 100 steps (bench_lengths.py)
#   large100 GPT-2 large at 24 GiB, one shape, 100 steps (bench_lengths.py)
#   lengths_fixed the lengths part with the allocator's fixed segments (bench_lengths.py --allocator fixed)
#   lengths64 the lengths part with every batch padded to a multiple of 64 tokens, as a collator can pad
#   lengths_nocudnn the lengths part with cuDNN's attention off (its execution plan is built per new shape)
#   lengths_nobuckets the lengths part with attention at each batch's own length (AUTOTUNE_ATTENTION_BUCKETS=0)
#   onelength the lengths part over batches of one length each, no mask, tuned with max_length=1024
#   onelength_typical the onelength part with fit given a batch at the middle length (--example typical)
#   onelength_split  the onelength_typical plan's step at fixed lengths in order (--length-plan), each micro-step timed
#   roof     W1's roof: the model compiled whole, uncapped, at micro-batch 8 and at 4 (bench_fit.py --method roof)
#   fp8      the 1.1B Llama at 24 GiB with fp8 allowed, beside bf16 and the uncapped bf16 roof, FP8_STEPS steps
#            each (100; FP8_RUNS=fp8 trains the fp8 plan alone beside the roof; the issue's 200 take about 13 minutes, over one call's 10: start it with setsid)
#   fp8w1    W1 (GPT-2 large, 24 GiB, global batch 64) with fp8 allowed, its fp8 plan beside the roof, FP8_STEPS steps
#   modes    W1's model at micro-batch 4 uncapped: whole (roof), blocks dynamic, blocks static, blocks + chunked loss
#   headloss the chunked loss at GPT-2 large's head, vocabulary padded against unpadded (bench_head_loss.py)
#   new_length the cost of a step at a new length, with and without attention's buckets (bench_new_length.py)
#   large100_fixed the large100 part with the allocator's fixed segments
#   lightning        the Lightning script under `autotune run`, its trials forked (the default)
#   lightning_fresh  the same with AUTOTUNE_FORK_TRIALS=0, every trial a fresh process
# W1_STEPS sets w1cold's training steps (20). benchmarks/gpu_streams.sh runs several of these side by side, one per GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/session-$(date +%Y%m%dT%H%M%S)}
mkdir -p "$OUT"
PARTS=${PARTS:-"w1cold w1warm offload frameworks"}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-w1}
declare -A LIMIT=([w1cold]=${W1COLD_S:-240} [w1warm]=${W1WARM_S:-120} [offload]=${OFFLOAD_S:-150} [frameworks]=${FRAMEWORKS_S:-150}
                 [grid]=${GRID_S:-330} [w2]=${W2_S:-240} [w3]=${W3_S:-200} [blocks]=${BLOCKS_S:-120} [ckpt]=${CKPT_S:-200}
                 [moe]=${MOE_S:-120} [llama3b]=${LLAMA3B_S:-420} [llama1b]=${LLAMA1B_S:-240}
                 [llama8b]=${LLAMA8B_S:-1200} [lengths]=${LENGTHS_S:-420} [large100]=${LARGE100_S:-480}
                 [lengths_fixed]=${LENGTHS_S:-420} [lengths64]=${LENGTHS_S:-420} [lengths_nocudnn]=${LENGTHS_S:-420} [lengths_nobuckets]=${LENGTHS_S:-420} [new_length]=${NEW_LENGTH_S:-420} [large100_fixed]=${LARGE100_S:-480} [lightning]=${LIGHTNING_S:-200} [lightning_fresh]=${LIGHTNING_S:-200}
                 [onelength]=${LENGTHS_S:-420} [onelength_typical]=${LENGTHS_S:-420} [onelength_split]=${LENGTHS_S:-420} [roof]=${ROOF_S:-240} [headloss]=${HEADLOSS_S:-60} [modes]=${MODES_S:-420} [fp8]=${FP8_S:-560} [fp8w1]=${FP8_S:-560})

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
        w1cold) part w1cold env TORCH_LOGS=recompiles python benchmarks/bench_lattice.py --method fit --steps "${W1_STEPS:-20}" --out "$OUT/w1.jsonl" ;;
        w1warm) part w1warm python benchmarks/bench_lattice.py --method fit --steps 0 --out "$OUT/w1.jsonl" ;;
        offload) part offload bash -c "python benchmarks/bench_offload.py --workload W1 --config 0,8 --compile --steps 6 --out $OUT/offload.jsonl; python benchmarks/bench_offload.py --workload W2 --config 48,8 --steps 4 --out $OUT/offload.jsonl" ;;
        grid) part grid python benchmarks/bench_lattice.py --method grid --steps 20 --out "$OUT/w1grid.jsonl" ;;
        w2) part w2 python benchmarks/bench_peers.py --workload W2 --methods autotune-cold --steps 20 --deadline $((LIMIT[w2] - 30)) --out "$OUT/w2.jsonl" ;;
        w3) part w3 python benchmarks/bench_peers.py --workload W3 --methods grid,autotune-cold --steps 30 --deadline $((LIMIT[w3] - 30)) --out "$OUT/w3.jsonl" ;;
        ckpt) part ckpt bash -c "python benchmarks/bench_offload.py --workload W2 --config 48,8 --compile --modes serial --steps 3 --out $OUT/ckpt.jsonl; python benchmarks/bench_offload.py --workload W2 --config 48,8 --modes serial --steps 3 --out $OUT/ckpt.jsonl" ;;
        blocks) part blocks python benchmarks/bench_blocks.py --device cuda --out "$OUT/blocks.jsonl" ;;
        moe) part moe python benchmarks/bench_moe.py --out "$OUT/moe" ;;
        llama3b) part llama3b python benchmarks/bench_llama.py --size 3b --budget 24GiB --global-batch-size 32 --steps 20 --out "$OUT/llama.jsonl" ;;
        llama1b) part llama1b python benchmarks/bench_llama.py --size 1.1b --budget 24GiB --global-batch-size 32 --steps 5 --out "$OUT/llama.jsonl" ;;
        llama8b) part llama8b python benchmarks/bench_llama.py --size 8b --budget 76GiB --global-batch-size 64 --steps 10 --out "$OUT/llama.jsonl" ;;
        lengths) part lengths python benchmarks/bench_lengths.py --model gpt2-medium --budget 10GiB --min-length 256 --max-length 1024 --global-batch-size 32 --steps 100 --out "$OUT/lengths.jsonl" ;;
        lengths_nocudnn) part lengths_nocudnn python benchmarks/bench_lengths.py --model gpt2-medium --budget 10GiB --min-length 256 --max-length 1024 --global-batch-size 32 --steps 100 --no-cudnn-attention --out "$OUT/lengths.jsonl" ;;
        lengths_nobuckets) part lengths_nobuckets python benchmarks/bench_lengths.py --model gpt2-medium --budget 10GiB --min-length 256 --max-length 1024 --global-batch-size 32 --steps 100 --no-attention-buckets --out "$OUT/lengths.jsonl" ;;
        new_length) part new_length bash -c "python benchmarks/bench_new_length.py --out '$OUT/new_length.jsonl' && python benchmarks/bench_new_length.py --no-attention-buckets --out '$OUT/new_length.jsonl'" ;;
        onelength) part onelength python benchmarks/bench_lengths.py --model gpt2-medium --budget 10GiB --min-length 256 --max-length 1024 --one-length --global-batch-size 32 --steps 100 --out "$OUT/lengths.jsonl" ;;
        onelength_split) part onelength_split python benchmarks/bench_lengths.py --model gpt2-medium --budget 10GiB --min-length 256 --max-length 1024 --one-length --example typical --global-batch-size 32 --length-plan 640x5,1024x4,640x4,600x5,320x4 --out "$OUT/lengths.jsonl" ;;
        onelength_typical) part onelength_typical python benchmarks/bench_lengths.py --model gpt2-medium --budget 10GiB --min-length 256 --max-length 1024 --one-length --example typical --global-batch-size 32 --steps 100 --out "$OUT/lengths.jsonl" ;;
        roof) part roof bash -c "python benchmarks/bench_fit.py --method roof --steps 10 --out '$OUT/roof.jsonl' && python benchmarks/bench_fit.py --method roof --roof-micro 4 --steps 6 --out '$OUT/roof.jsonl'" ;;
        fp8) part fp8 python benchmarks/bench_fp8.py --size 1.1b --seq 2048 --budget 24GiB --global-batch-size 32 --steps "${FP8_STEPS:-100}" --runs "${FP8_RUNS:-bf16,fp8}" --roof-micro 8 --out "$OUT/fp8.json" ;;
        fp8w1) part fp8w1 python benchmarks/bench_fp8.py --size gpt2-large --seq 1024 --budget 24GiB --global-batch-size 64 --steps "${FP8_STEPS:-100}" --runs "${FP8_RUNS:-fp8}" --roof-micro 8 --out "$OUT/fp8w1.json" ;;
        headloss) part headloss python benchmarks/bench_head_loss.py ;;
        modes) part modes bash -c "for v in roof blocks 'blocks --static' 'blocks --loss chunked' 'blocks --static --loss chunked'; do python benchmarks/bench_compile_modes.py --compile \$v 2>&1 | grep RESULT; done" ;;
        lengths64) part lengths64 python benchmarks/bench_lengths.py --model gpt2-medium --budget 10GiB --min-length 256 --max-length 1024 --global-batch-size 32 --steps 100 --length-multiple 64 --out "$OUT/lengths.jsonl" ;;
        lengths_fixed) part lengths_fixed python benchmarks/bench_lengths.py --model gpt2-medium --budget 10GiB --min-length 256 --max-length 1024 --global-batch-size 32 --steps 100 --allocator fixed --out "$OUT/lengths.jsonl" ;;
        large100_fixed) part large100_fixed python benchmarks/bench_lengths.py --model gpt2-large --budget 24GiB --max-length 1024 --global-batch-size 64 --steps 100 --allocator fixed --out "$OUT/lengths.jsonl" ;;
        large100) part large100 python benchmarks/bench_lengths.py --model gpt2-large --budget 24GiB --max-length 1024 --global-batch-size 64 --steps 100 --out "$OUT/lengths.jsonl" ;;
        lightning) part lightning env OUTDIR="$OUT/lightning" ONLY=lightning STEPS=20 TIMEOUT="${LIMIT[lightning]}" bash benchmarks/bench_frameworks.sh ;;
        lightning_fresh) part lightning_fresh env AUTOTUNE_FORK_TRIALS=0 OUTDIR="$OUT/lightning_fresh" ONLY=lightning STEPS=20 TIMEOUT="${LIMIT[lightning_fresh]}" bash benchmarks/bench_frameworks.sh ;;
        frameworks) part frameworks env OUTDIR="$OUT/frameworks" ONLY="${FRAMEWORKS_ONLY:-}" STEPS=20 TIMEOUT="${LIMIT[frameworks]}" bash benchmarks/bench_frameworks.sh ;;
    esac
done
echo "== summary"; cat "$OUT/gpu.txt" "$OUT/summary.txt"
grep -h "^fit:\|^train \|Recompiling" "$OUT"/w1*.log "$OUT"/grid.log 2>/dev/null | cut -c1-220 | head -12
grep -h "step .*tail\|tail cut\|^W[12]\|Error" "$OUT"/offload.log "$OUT"/ckpt.log 2>/dev/null | cut -c1-200
grep -h "^| [lh]" "$OUT"/frameworks/summary.md "$OUT"/lightning*/summary.md 2>/dev/null
tail -qn1 "$OUT"/llama.jsonl 2>/dev/null | cut -c1-400
python3 - "$OUT"/lengths.jsonl <<'PY' 2>/dev/null
import json, sys
for line in open(sys.argv[1]):  # the figures, not the per-step lists
    row = json.loads(line)
    print({k: v for k, v in row.items() if k not in ("step_seconds", "padded_lengths", "versions", "reason")})
PY
