#!/usr/bin/env bash
# Issue 33's open choice, the repack default, on the GPU machine's 16 cores (CUDA hidden): moestream serve
# -np 4 at 1 and 4 streams, every expert in RAM (benchmarks/batch_servers.py, no llama-server), with
# MOESTREAM_GGML_REPACK=1 and =0 alternated (ORDER, default "1 0 1 0"), on `make native`'s CPU build of ggml
# (built there from .gpu/ggml-src.tar.xz: benchmarks/llamacpp/trim_source.sh --ggml) and the 24 x 128
# Q4_K_M synthetic with Qwen3's vocabulary (written unless a warm machine kept it in /tmp).
#   run(command="bash benchmarks/batch_repack_lease.sh", carry=[".gpu/whl", ".gpu/srvwhl",
#     ".gpu/ggml-src.tar.xz"])
# Outputs under $OUT: bs-<repack>-<seconds>.json and .log per run; BUDGET (450 s): no run starts after it.
set -uo pipefail
export PYTHONUNBUFFERED=1 MODEL=${MODEL:-/tmp/q24v.gguf}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .gpu/whl/*.whl .gpu/srvwhl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
if [ ! -f /tmp/ggml-native/lib/libggml-cpu.so ]; then
  mkdir -p /tmp/ggml-src && tar xJf .gpu/ggml-src.tar.xz -C /tmp/ggml-src || exit 1
  python3 -m moestream.ggml.build --source /tmp/ggml-src/llama.cpp --dest /tmp/ggml-native --jobs 16 \
    > /tmp/ggml-native.log 2>&1 || { tail -5 /tmp/ggml-native.log; exit 1; }
fi
echo "ggml built (T=$SECONDS)"
export MOESTREAM_GGML_LIB=/tmp/ggml-native/lib CUDA_VISIBLE_DEVICES=
[ -f "$MODEL" ] || { python3 -m moestream synth "$MODEL" --preset qwen3-30b-a3b --layers 24 --experts 128 \
  --quant Q4_K_M --threads 16 --vocab-size 151936 > $OUT/synth.log 2>&1 || { tail -3 $OUT/synth.log; exit 1; }; }
echo "model ready (T=$SECONDS)"
for r in ${ORDER:-1 0 1 0}; do
  [ $SECONDS -lt ${BUDGET:-450} ] || { echo "budget: repack=$r not run"; continue; }
  n=bs-$r-$SECONDS
  echo "== MOESTREAM_GGML_REPACK=$r (T=$SECONDS)"
  MOESTREAM_GGML_REPACK=$r python3 benchmarks/batch_servers.py "$MODEL" --threads 16 --streams 1,4 --tokens 64 \
    --reps ${REPS:-1} --out $OUT/$n.json > $OUT/$n.log 2>&1
  grep -E "mode|moestream +\|" $OUT/$n.log | cut -c1-300
done
