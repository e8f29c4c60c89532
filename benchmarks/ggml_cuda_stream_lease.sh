#!/usr/bin/env bash
# A lease call for issue 31 item 6 (run from the repository root on the GPU machine, `.gpu/` carried):
# experts bigger than RAM and VRAM together. moestream's GPU tier over a host cache smaller than the
# experts, each miss of both read from disk (O_DIRECT), on the 24 x 128 Q4_K_M synthetic of
# Qwen3-30B-A3B's shape (8.4 GiB; written here if ggml_cuda_lease.sh has not left it in /tmp): decode
# tok/s, bytes read from disk per decoded token, the read rate while decoding and the disk's O_DIRECT
# ceiling for this file's experts measured before the load and after the runs, in the same process
# (benchmarks/ggml_cuda.py speed --ceiling). RUNS: cache:tier:misses entries; PREFETCH: off (default), on or auto. Outputs under $OUT
# (stream-*.log).
set -uo pipefail
. benchmarks/ggml_cuda_env.sh || exit 1
nvidia-smi -L; nproc; free -g | head -2; df -h /tmp | tail -1
synth_model || { tail -5 $OUT/synth.log; exit 1; }
for run in ${RUNS:-5GiB:2GiB:upload 5GiB:2GiB:host}; do
  IFS=: read -r cache tier misses <<< "$run"
  echo "== cache $cache, tier $tier, misses $misses"
  python3 benchmarks/ggml_cuda.py speed "$MODEL" --cache $cache --gpu-tier $tier --tier-misses $misses \
    --prompts ${PROMPTS:-36} --tokens 32 --threads $THREADS --repeats 2 --ceiling ${CEILING:-10} \
    --compare ${COMPARE:-0} --prefetch ${PREFETCH:-off} > $OUT/stream-$cache-$tier-$misses-${PREFETCH:-off}.log 2>&1
  grep -v '^moestream' $OUT/stream-$cache-$tier-$misses-${PREFETCH:-off}.log | tail -4
done
