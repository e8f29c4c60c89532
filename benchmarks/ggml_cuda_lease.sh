#!/usr/bin/env bash
# One lease of the GPU machine for issue 31 (run from the repository root there, `.gpu/` carried):
# llama.cpp's CUDA build and ggml's CUDA library from ../shared/h200 (its three tar parts), wheels the
# image lacks (gguf; transformers >= 5.24 for a GGUF's tokenizer), the 24 x 128 Q4_K_M synthetic of
# Qwen3-30B-A3B's shape written while the tiny models' checks run, then llama-bench and moestream on it.
# Outputs under $OUT (check.log, llama-bench.json, speed.log).
set -uo pipefail
. benchmarks/ggml_cuda_env.sh || exit 1
nvidia-smi -L; nproc; free -g | head -2
[ -f "$MODEL" ] || { synth_model & synth=$!; }  # written while the checks run
python3 benchmarks/ggml_cuda.py check ${CHECK_FAMILIES:+--families $CHECK_FAMILIES} 2>&1 | tee $OUT/check.log | tail -14
[ -n "${synth:-}" ] && { wait $synth; tail -3 $OUT/synth.log; }
$LC/llama-bench -m "$MODEL" -ngl 99 -p 36,512 -n 32 -r 3 -o json > $OUT/llama-bench.json 2> $OUT/llama-bench.err
bench_rows "llama.cpp -ngl 99" $OUT/llama-bench.json
python3 benchmarks/ggml_cuda.py speed "$MODEL" --prompts 36,512 --tokens 32 --threads $THREADS 2>&1 | tee $OUT/speed.log | tail -4
# llama.cpp with every expert on the CPU (the baseline of the GPU tier, ggml_cuda_tier_lease.sh) while
# the call has time left (kept in /tmp for that script's call on the same warm machine)
if [ -n "${NCMOE:-}" ] && [ $SECONDS -lt ${NCMOE_BEFORE:-420} ]; then
  ncmoe_baseline
fi
# the same decode with no scratch reused at all (no fused run's output can overlap an input), with the
# query uncopied, and with ggml's CUDA fusions off: what the scratch layout, the copy and the fusions cost
if [ -n "${AB:-}" ]; then
  MOESTREAM_GGML_SCRATCH_REUSE=0 python3 benchmarks/ggml_cuda.py speed "$MODEL" --prompts 36 --tokens 32 --compare 0 2>&1 | tail -2 | tee $OUT/speed-noreuse.log
  # flash attention's query not copied: the permuted view, and a one-token query reshaped (its tokens
  # against the CPU graphs': --compare)
  for q in view reshape; do
    MOESTREAM_GGML_QUERY=$q python3 benchmarks/ggml_cuda.py speed "$MODEL" --prompts 36 --tokens 32 --compare 16 2>&1 | tail -3 | tee $OUT/speed-q$q.log
  done
  GGML_CUDA_DISABLE_FUSION=1 python3 benchmarks/ggml_cuda.py speed "$MODEL" --prompts 36 --tokens 32 --compare 0 2>&1 | tail -2 | tee $OUT/speed-nofusion.log
fi
