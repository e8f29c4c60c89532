# Sourced by the GPU machine's lease scripts (ggml_cuda_lease.sh, ggml_cuda_tier_lease.sh,
# ggml_cuda_stream_lease.sh; run from the repository root there, `.gpu/` carried): the wheels the image
# lacks (gguf; transformers >= 5.24 for a GGUF's tokenizer) into /tmp/site, llama.cpp's CUDA build and
# ggml's CUDA library from ../shared/h200's tar parts into /tmp (once a machine), the environment that
# points moestream and llama.cpp at them, MODEL and THREADS, and the helpers the scripts share. The server's
# wheels (.gpu/srvwhl: fastapi, uvicorn, pydantic) where carried.
export PYTHONUNBUFFERED=1
# WHL: the wheels' folder (.gpu/whl; .gpu/whl-slim: benchmarks/slim_wheel.py's transformers, for a call that
# carries the server's wheels and ggml's source beside llama.cpp's build)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL:-.gpu/whl}/*.whl \
  $(ls .gpu/srvwhl/*.whl 2>/dev/null) || return 1
export PYTHONPATH=/tmp/site:$PWD
[ -d /tmp/llama.cpp-cuda-sm90 ] || { cat .gpu/llama-cuda.tar.xz.part0* | tar xJ -C /tmp || return 1; }
LC=/tmp/llama.cpp-cuda-sm90
export MOESTREAM_GGML_LIB=$LC LD_LIBRARY_PATH=$LC${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# NATIVE_CPU=1: ggml's CPU library built here from .gpu/ggml-src.tar.xz (`make native`'s build: ggml's own
# thread pool, not the prebuilt one's OpenMP; benchmarks/llamacpp/trim_source.sh --ggml makes the tar), beside
# the prebuilt base and CUDA libraries of the same ggml (libggml-cpu binds to the base loaded first)
if [ -n "${NATIVE_CPU:-}" ]; then
  if [ ! -f /tmp/ggml-mixed/libggml-cpu.so ]; then
    [ -d /tmp/ggml-src/llama.cpp ] || { mkdir -p /tmp/ggml-src && tar xJf .gpu/ggml-src.tar.xz -C /tmp/ggml-src; } || return 1
    python3 -m moestream.ggml.build --source /tmp/ggml-src/llama.cpp --dest /tmp/ggml-native --jobs 12 \
      > /tmp/ggml-native.log 2>&1 || { tail -5 /tmp/ggml-native.log; return 1; }
    mkdir -p /tmp/ggml-mixed
    for f in $LC/libggml-base.so* $LC/libggml-cuda.so*; do ln -sf $f /tmp/ggml-mixed/; done
    for f in /tmp/ggml-native/lib/libggml-cpu.so*; do ln -sf $f /tmp/ggml-mixed/; done
  fi
  export MOESTREAM_GGML_LIB=/tmp/ggml-mixed
fi
MODEL=${MODEL:-/tmp/q24.gguf}
THREADS=${THREADS:-8}

# bench_rows LABEL FILE: a llama-bench JSON's rows as "LABEL prompt-tokens generated-tokens tok/s", and
# "repack=0" where a row ran without llama.cpp's extra buffer types (`--repack 0`: no CPU_REPACK, no AMX)
bench_rows() {
  python3 -c "import json,sys; [print(sys.argv[1], r['n_prompt'], r['n_gen'], round(r['avg_ts'],1), *(['repack=0'] if r.get('repack') is False else [])) for r in json.load(open(sys.argv[2]))]" "$1" "$2"
}

# ncmoe_baseline: llama.cpp with every expert on the CPU (-ngl 99 --n-cpu-moe 24), the GPU tier's
# baseline, measured once a machine (kept in /tmp/ncmoe.json for the lease's later calls), into $OUT
ncmoe_baseline() {
  [ -s /tmp/ncmoe.json ] || $LC/llama-bench -m "$MODEL" -ngl 99 --n-cpu-moe 24 -t $THREADS -p 36,512 -n 32 -r 2 \
    -o json > /tmp/ncmoe.json 2> $OUT/llama-bench-ncmoe.err
  cp /tmp/ncmoe.json $OUT/llama-bench-ncmoe.json
  bench_rows "llama.cpp n-cpu-moe" /tmp/ncmoe.json
}

# server_wheels: whether moestream serve can start here (.gpu/srvwhl carried); says what is missing if not
server_wheels() {
  python3 -c "import fastapi, uvicorn" 2>/dev/null || { echo "moestream serve needs .gpu/srvwhl carried"; return 1; }
}

# synth_model: the 24 x 128 (LAYERS x 128) Q4_K_M synthetic of Qwen3-30B-A3B's shape at $MODEL, unless
# there (3 minutes on that machine; its output in $OUT/synth.log); VOCAB=151936: Qwen3's vocabulary size
# (the LM head a real model's; else the synthetic tokenizer's, whose logits are 4 KiB)
synth_model() {
  [ -f "$MODEL" ] || { time python3 -m moestream synth "$MODEL" --preset qwen3-30b-a3b --layers ${LAYERS:-24} \
    --experts 128 --quant Q4_K_M --threads 12 ${VOCAB:+--vocab-size $VOCAB}; } > $OUT/synth.log 2>&1
}
