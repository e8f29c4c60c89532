#!/usr/bin/env bash
# Greedy tokens of moestream's graphs on ggml's CUDA backend against llama-server's CUDA build (-ngl 99),
# and of moestream's CPU graphs against llama-server's CPU path, on one GGUF (the trained fixture's):
#   bash benchmarks/llamacpp/greedy_cuda.sh FILE.gguf   (after ggml_cuda_lease.sh set /tmp up)
set -uo pipefail
GGUF=$1
LC=/tmp/llama.cpp-cuda-sm90
export PYTHONPATH=/tmp/site:$PWD MOESTREAM_GGML_LIB=$LC LD_LIBRARY_PATH=$LC PYTHONUNBUFFERED=1
serve() {  # llama-server on $GGUF with the given options, waited for
  $LC/llama-server -m "$GGUF" --port 18411 -c 512 -t 1 "$@" > /tmp/llama-server.log 2>&1 &
  server=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:18411/health > /dev/null && return 0; sleep 0.5; done
  tail -5 /tmp/llama-server.log; return 1
}
echo "== CUDA: moestream on ggml's CUDA backend, llama-server -ngl 99"
serve -ngl 99 && MOESTREAM_GGML_BACKEND=cuda python3 benchmarks/llamacpp/greedy_equal.py "$GGUF" --port 18411
kill $server; wait $server 2>/dev/null
echo "== CPU: moestream's CPU graphs, llama-server -ngl 0 with CUDA hidden"
CUDA_VISIBLE_DEVICES= serve -ngl 0 && python3 benchmarks/llamacpp/greedy_equal.py "$GGUF" --port 18411
kill $server; wait $server 2>/dev/null
