#!/usr/bin/env bash
# Issue 33 item 4's streaming targets on the GPU machine's 16 cores (CUDA hidden): llama-server -np 4 and
# moestream serve -np 4 on the same file, each in a cgroup of its own limited to LIMIT (5 GiB) with the page
# cache dropped before it starts, at STREAMS (1,4) concurrent requests of TOKENS (32) greedy tokens, the
# disk's read-ahead RA KiB (128: llama.cpp's best under a limit on 12-07), both servers' bytes read from
# disk per token by the disk's counter (benchmarks/batch_servers.py --memory-limit). moestream on `make
# native`'s ggml CPU library built there, llama-server on its prebuilt one; the 24 x 128 Q4_K_M synthetic
# with Qwen3's vocabulary, written unless a warm machine kept it in /tmp (2.5 minutes).
#   run(command="WHL=.gpu/whl-slim bash benchmarks/batch_stream_lease.sh", carry=[".gpu/llama-cuda.tar.xz.part00",
#     ".gpu/llama-cuda.tar.xz.part01", ".gpu/llama-cuda.tar.xz.part02", ".gpu/whl-slim", ".gpu/srvwhl",
#     ".gpu/ggml-src.tar.xz"])   (the full .gpu/whl with these is over the 64 MiB a call carries:
#     benchmarks/slim_wheel.py .gpu/whl/transformers-*.whl .gpu/whl-slim, and gguf's wheel copied beside it)
# RAM=1 first runs the same servers with every expert in RAM (no limit, RAM_TOKENS 64 tokens, RAM_REPS 2
# rounds): issue 33's in-RAM target against llama-server -np 4, in the same call.
# SIDE=1 last runs benchmarks/side_by_side.py at 16 threads (a round of four prompts side by side against in
# turn, on a 3.4 GiB cache: what a round's steps side by side save where the disk reads 1.9 GiB/s).
# Outputs under $OUT: batch-ram.json, batch-stream.json, their servers' logs, batch-ram.log, batch-stream.log,
# side-by-side.log.
set -uo pipefail
export MODEL=${MODEL:-/tmp/q24v.gguf} VOCAB=${VOCAB:-151936} NATIVE_CPU=1
. benchmarks/ggml_cuda_env.sh || exit 1
server_wheels || exit 2
synth_model || { tail -5 $OUT/synth.log; exit 1; }
echo "model ready (T=$SECONDS)"
# servers NAME TOKENS REPS [ARG...]: both servers at STREAMS (batch_servers.py), NAME.json and NAME.log in $OUT
servers() {
  local name=$1 tokens=$2 reps=$3
  shift 3
  CUDA_VISIBLE_DEVICES= python3 benchmarks/batch_servers.py "$MODEL" --llama-server $LC/llama-server --threads 16 \
    --streams ${STREAMS:-1,4} --tokens $tokens --reps $reps --ready-timeout 300 --request-timeout 300 "$@" \
    --out $OUT/$name.json 2>&1 | tee $OUT/$name.log | cut -c1-400
}
[ -n "${RAM:-}" ] && servers batch-ram ${RAM_TOKENS:-64} ${RAM_REPS:-2}
servers batch-stream ${TOKENS:-32} ${REPS:-1} --memory-limit ${LIMIT:-5GiB} --read-ahead ${RA:-128}
[ -n "${SIDE:-}" ] && CUDA_VISIBLE_DEVICES= python3 benchmarks/side_by_side.py "$MODEL" --cache 3400MiB --threads 16 \
  --reps 2 2>&1 | tee $OUT/side-by-side.log | cut -c1-300
