#!/usr/bin/env bash
# Issue 31 item 8 on the GPU machine: the CPU row and the three regimes, moestream beside llama.cpp on the
# same file in the same call, each call under the 10-minute limit (run from the repository root there,
# `.gpu/` carried: the llama-cuda tar parts, whl, for PART=cpu ggml-src.tar.xz, for PART=stream srvwhl).
# The 24 x 128 Q4_K_M synthetic with Qwen3's vocabulary is written unless a warm machine kept it in /tmp
# (2.5 minutes).
#   PART=cpu   CUDA hidden, ggml's CPU library built there (`make native`'s build): for each of THREADS_LIST
#              (1 2 4 8 16) llama-bench -ngl 0 -t N and moestream's CPU graphs at N threads, 36-token
#              prompt and 32 tokens, every expert in RAM. LLAMA_REPACK=0,1 runs llama-bench without its
#              extra buffer types too (its CPU_REPACK and, on a CPU with AMX, the AMX one for 2D matrices:
#              moestream uses neither by default); MS_REPACK="0 1" moestream with MOESTREAM_GGML_REPACK=1
#              too (CPU_REPACK copies of the experts and the trunk)
#   PART=gpu   first the tiny linear-attention families with ggml's CUDA graphs off and on (on by default
#              since 12-07, when this check found them right; benchmarks/ggml_cuda.py check); then
#              ggml_cuda_lease.sh (every expert in VRAM: llama-bench -ngl 99 against ggml_cuda.py speed;
#              the --n-cpu-moe 24 baseline) and ggml_cuda_tier_lease.sh (a 2 GiB GPU tier over a host
#              cache of every expert, misses uploaded)
#   PART=stream  benchmarks/ggml_cuda_stream_vs_llama.sh (5 GiB limit, llama.cpp at 128 KiB read-ahead,
#              moestream auto with and without --prefetch, 8 I/O threads)
# Outputs under $OUT: <part>.log and each tool's own output; BUDGET (480 s): no step starts after it.
set -uo pipefail
PART=${PART:?PART=cpu, gpu or stream}
export MODEL=${MODEL:-/tmp/q24v.gguf} VOCAB=${VOCAB:-151936}
[ "$PART" = cpu ] && export NATIVE_CPU=1
. benchmarks/ggml_cuda_env.sh || exit 1
synth_model || { tail -5 $OUT/synth.log; exit 1; }
echo "model ready (T=$SECONDS)"
left() { [ $SECONDS -lt ${BUDGET:-480} ] || { echo "budget: $1 not run"; return 1; }; }
case $PART in
cpu)
  for t in ${THREADS_LIST:-1 2 4 8 16}; do
    left "threads $t" || continue
    CUDA_VISIBLE_DEVICES= $LC/llama-bench -m "$MODEL" -ngl 0 -t $t -p 36 -n 32 -r 2 --repack ${LLAMA_REPACK:-1} \
      -o json > $OUT/cpu-llama-$t.json 2> $OUT/cpu-llama-$t.err
    bench_rows "llama.cpp t=$t" $OUT/cpu-llama-$t.json
    for r in ${MS_REPACK:-0}; do
      CUDA_VISIBLE_DEVICES= MOESTREAM_GGML_REPACK=$r python3 benchmarks/ggml_cuda.py speed "$MODEL" --backend cpu \
        --threads $t --prompts 36 --tokens 32 --repeats 2 --compare 0 > $OUT/cpu-moestream-$t-r$r.log 2>&1
      echo "moestream t=$t repack=$r: $(grep -E '^\{' $OUT/cpu-moestream-$t-r$r.log | tail -1 | cut -c1-200)"
    done
  done 2>&1 | tee $OUT/cpu.log
  ;;
gpu)
  {
    # the linear-attention families with their CUDA graphs off, then the lease script with them on (the
    # default): its check of them beside qwen3_moe, llama-bench -ngl 99 against moestream with every
    # expert in VRAM, and the --n-cpu-moe 24 baseline; then the 2 GiB tier
    echo "== MOESTREAM_CUDA_GRAPHS=0"
    MOESTREAM_CUDA_GRAPHS=0 timeout 120 python3 benchmarks/ggml_cuda.py check --families qwen3_next,qwen3_5_moe 2>&1 | tail -3
    echo "== MOESTREAM_CUDA_GRAPHS=1"
    MOESTREAM_CUDA_GRAPHS=1 CHECK_FAMILIES=qwen3_next,qwen3_5_moe,qwen3_moe NCMOE=1 NCMOE_BEFORE=${BUDGET:-480} \
      bash benchmarks/ggml_cuda_lease.sh
    left "the tier regime" && RUNS=2GiB:upload bash benchmarks/ggml_cuda_tier_lease.sh
  } 2>&1 | tee $OUT/gpu.log
  ;;
stream)
  # moestream runs as a server there: without its wheels every moestream run fails (12-07 seventh session)
  server_wheels || exit 2
  IO=${IO:-8} LLAMA_RA=${LLAMA_RA:-128} BUDGET=${BUDGET:-400} bash benchmarks/ggml_cuda_stream_vs_llama.sh \
    2>&1 | tee $OUT/stream.log
  ;;
*) echo "PART=$PART: say cpu, gpu or stream"; exit 2 ;;
esac
