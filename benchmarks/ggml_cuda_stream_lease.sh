#!/usr/bin/env bash
# A lease call for issue 31 item 6 (run from the repository root on the GPU machine, `.gpu/` carried):
# experts bigger than RAM and VRAM together. moestream's GPU tier over a host cache smaller than the
# experts, each miss of both read from disk (O_DIRECT), on the 24 x 128 Q4_K_M synthetic of
# Qwen3-30B-A3B's shape (8.4 GiB; written here if ggml_cuda_lease.sh has not left it in /tmp): decode
# tok/s, bytes read from disk per decoded token, the read rate while decoding and the disk's O_DIRECT
# ceiling for this file's experts measured before the load and after the runs, in the same process
# (benchmarks/ggml_cuda.py speed --ceiling). RUNS: cache:tier:misses entries. Outputs under $OUT
# (stream-*.log).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
[ -d /tmp/llama.cpp-cuda-sm90 ] || { cat .gpu/llama-cuda.tar.xz.part0* | tar xJ -C /tmp || exit 1; }
LC=/tmp/llama.cpp-cuda-sm90
export MOESTREAM_GGML_LIB=$LC LD_LIBRARY_PATH=$LC${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi -L; nproc; free -g | head -2; df -h /tmp | tail -1
MODEL=${MODEL:-/tmp/q24.gguf}
THREADS=${THREADS:-8}
if [ ! -f "$MODEL" ]; then
  (time python3 -m moestream synth "$MODEL" --preset qwen3-30b-a3b --layers 24 --experts 128 \
     --quant Q4_K_M --threads 12) > $OUT/synth.log 2>&1 || { tail -5 $OUT/synth.log; exit 1; }
  tail -3 $OUT/synth.log
fi
for run in ${RUNS:-5GiB:2GiB:upload 5GiB:2GiB:host}; do
  IFS=: read -r cache tier misses <<< "$run"
  echo "== cache $cache, tier $tier, misses $misses"
  python3 benchmarks/ggml_cuda.py speed "$MODEL" --cache $cache --gpu-tier $tier --tier-misses $misses \
    --prompts ${PROMPTS:-36} --tokens 32 --threads $THREADS --repeats 2 --ceiling ${CEILING:-10} \
    --compare ${COMPARE:-0} > $OUT/stream-$cache-$tier-$misses.log 2>&1
  grep -v '^moestream' $OUT/stream-$cache-$tier-$misses.log | tail -4
done
