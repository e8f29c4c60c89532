#!/usr/bin/env bash
# Issue 33 on the GPU machine's 16 cores, both engines built there from one ggml as issue 23's CPU
# comparison was (the prebuilt OpenMP library of ../shared/h200 ran moestream's CPU graphs at 32-34 tok/s
# from every thread arrangement where llama-server reached 75 with it, 12-06 lease 9): llama.cpp's CPU
# llama-server (its default build) and moestream's `make native` ggml (ggml's own thread pool) from
# `.gpu/llama-src.tar.xz` (benchmarks/llamacpp/trim_source.sh), the 24 x 128 Q4_K_M synthetic written with
# the native library while llama.cpp builds, then llama-server -np 4 against moestream serve -np 4 at 1
# and 4 streams, every expert in RAM (benchmarks/batch_servers.py), and the engine's thread check.
#   run(command="bash benchmarks/batch_native_lease.sh", carry=[".gpu/whl", ".gpu/srvwhl",
#     ".gpu/llama-src.tar.xz"])
# Outputs under $OUT (llama-build.log, ggml-build.log, synth.log, batch_servers.json and its logs).
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
  .gpu/srvwhl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
MODEL=${MODEL:-/tmp/q24.gguf} THREADS=${THREADS:-16}
nproc; free -g | head -2
[ -d /tmp/llama.cpp ] || tar xJf .gpu/llama-src.tar.xz -C /tmp || exit 1
LS=/tmp/lcb/bin/llama-server
if [ ! -x $LS ]; then
  { cmake -S /tmp/llama.cpp -B /tmp/lcb -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON \
      -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
      -DBUILD_SHARED_LIBS=OFF && time cmake --build /tmp/lcb --target llama-server -j ${JOBS:-10}; } > $OUT/llama-build.log 2>&1 &
  building=$!
fi
[ -f /tmp/ggml-native/lib/libggml-cpu.so ] || { time python3 -m moestream.ggml.build --source /tmp/llama.cpp \
  --dest /tmp/ggml-native --jobs 6; } > $OUT/ggml-build.log 2>&1 || { tail -5 $OUT/ggml-build.log; exit 1; }
export MOESTREAM_GGML_LIB=/tmp/ggml-native/lib
[ -f "$MODEL" ] || { time python3 -m moestream synth "$MODEL" --preset qwen3-30b-a3b --layers 24 --experts 128 \
  --quant Q4_K_M --threads 6; } > $OUT/synth.log 2>&1 || { tail -5 $OUT/synth.log; exit 1; }
[ -n "${building:-}" ] && { wait $building || { tail -20 $OUT/llama-build.log; exit 1; }; }
grep real $OUT/*.log
python3 benchmarks/compute_threads.py "$MODEL" $THREADS 2>&1 | grep -v '^moestream' | cut -c1-140 | tail -4
python3 benchmarks/batch_servers.py "$MODEL" --llama-server $LS --threads $THREADS --streams ${STREAMS:-1,4} \
  --tokens ${TOKENS:-64} --reps ${REPS:-2} --out $OUT/batch_servers.json 2>&1 | tail -12
