#!/usr/bin/env bash
# The second call of a lease for issue 31 item 5 (after ggml_cuda_lease.sh wrote /tmp/q24.gguf on the
# same warm machine): llama.cpp with every expert on the CPU (-ngl 99 --n-cpu-moe 24) against moestream's
# GPU tier of 2 and 1 GiB over a host tier holding every expert, a miss uploaded to its slot or computed
# by the CPU. Outputs under $OUT (llama-bench-ncmoe.json, tier-*.log).
set -uo pipefail
. benchmarks/ggml_cuda_env.sh || exit 1
ncmoe_baseline
for run in ${RUNS:-2GiB:upload 2GiB:host 2GiB:split 2GiB:auto 1GiB:auto}; do
  tier=${run%%:*} misses=${run##*:}
  echo "== tier $tier, misses $misses"
  python3 benchmarks/ggml_cuda.py speed "$MODEL" --gpu-tier $tier --tier-misses $misses --prompts 36,512 \
    --tokens 32 --threads $THREADS --repeats 2 --compare ${COMPARE:-0} > $OUT/tier-$tier-$misses.log 2>&1
  grep -v '^moestream' $OUT/tier-$tier-$misses.log | tail -4
done
