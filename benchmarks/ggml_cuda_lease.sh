#!/usr/bin/env bash
# One lease of the GPU machine for issue 31 (run from the repository root there, `.gpu/` carried):
# llama.cpp's CUDA build and ggml's CUDA library from ../shared/h200 (its three tar parts), wheels the
# image lacks (gguf; transformers >= 5.24 for a GGUF's tokenizer), the 24 x 128 Q4_K_M synthetic of
# Qwen3-30B-A3B's shape written while the tiny models' checks run, then llama-bench and moestream on it.
# Outputs under $OUT (check.log, llama-bench.json, speed.log).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
cat .gpu/llama-cuda.tar.xz.part0* | tar xJ -C /tmp || exit 1
LC=/tmp/llama.cpp-cuda-sm90
export MOESTREAM_GGML_LIB=$LC LD_LIBRARY_PATH=$LC${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi -L; nproc; free -g | head -2
MODEL=${MODEL:-/tmp/q24.gguf}
LAYERS=${LAYERS:-24}
if [ ! -f "$MODEL" ]; then
  (time python3 -m moestream synth "$MODEL" --preset qwen3-30b-a3b --layers "$LAYERS" --experts 128 \
     --quant Q4_K_M --threads 12) > $OUT/synth.log 2>&1 &
  synth=$!
fi
python3 benchmarks/ggml_cuda.py check ${CHECK_FAMILIES:+--families $CHECK_FAMILIES} 2>&1 | tee $OUT/check.log | tail -14
[ -n "${synth:-}" ] && { wait $synth; tail -3 $OUT/synth.log; }
$LC/llama-bench -m "$MODEL" -ngl 99 -p 36,512 -n 32 -r 3 -o json > $OUT/llama-bench.json 2> $OUT/llama-bench.err
python3 -c "import json,sys; [print(r['n_prompt'], r['n_gen'], round(r['avg_ts'],1)) for r in json.load(open(sys.argv[1]))]" $OUT/llama-bench.json
python3 benchmarks/ggml_cuda.py speed "$MODEL" --prompts 36,512 --tokens 32 --threads 8 2>&1 | tee $OUT/speed.log | tail -4
# llama.cpp with every expert on the CPU (the baseline of the GPU tier, ggml_cuda_tier_lease.sh) while
# the call has time left (kept in /tmp for that script's call on the same warm machine)
if [ -n "${NCMOE:-}" ] && [ $SECONDS -lt ${NCMOE_BEFORE:-420} ]; then
  $LC/llama-bench -m "$MODEL" -ngl 99 --n-cpu-moe 24 -t ${THREADS:-8} -p 36,512 -n 32 -r 2 -o json > /tmp/ncmoe.json 2> $OUT/llama-bench-ncmoe.err
  cp /tmp/ncmoe.json $OUT/llama-bench-ncmoe.json
  python3 -c "import json,sys; [print('llama.cpp n-cpu-moe', r['n_prompt'], r['n_gen'], round(r['avg_ts'],1)) for r in json.load(open(sys.argv[1]))]" /tmp/ncmoe.json
fi
# the same decode with no scratch reused at all (no fused run's output can overlap an input), and with
# ggml's CUDA fusions off: what the fusions and the scratch layout are worth
if [ -n "${AB:-}" ]; then
  MOESTREAM_GGML_SCRATCH_REUSE=0 python3 benchmarks/ggml_cuda.py speed "$MODEL" --prompts 36 --tokens 32 --compare 0 2>&1 | tail -2 | tee $OUT/speed-noreuse.log
  GGML_CUDA_DISABLE_FUSION=1 python3 benchmarks/ggml_cuda.py speed "$MODEL" --prompts 36 --tokens 32 --compare 0 2>&1 | tail -2 | tee $OUT/speed-nofusion.log
fi
