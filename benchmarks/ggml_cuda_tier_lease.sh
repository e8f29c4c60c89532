#!/usr/bin/env bash
# The second call of a lease for issue 31 item 5 (after ggml_cuda_lease.sh wrote /tmp/q24.gguf on the
# same warm machine): llama.cpp with every expert on the CPU (-ngl 99 --n-cpu-moe 24) against moestream's
# GPU tier of 2 and 1 GiB over a host tier holding every expert, a miss uploaded to its slot or computed
# by the CPU. Outputs under $OUT (llama-bench-ncmoe.json, tier-*.log).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
[ -d /tmp/llama.cpp-cuda-sm90 ] || { cat .gpu/llama-cuda.tar.xz.part0* | tar xJ -C /tmp || exit 1; }
LC=/tmp/llama.cpp-cuda-sm90
export MOESTREAM_GGML_LIB=$LC LD_LIBRARY_PATH=$LC${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
MODEL=${MODEL:-/tmp/q24.gguf}
THREADS=${THREADS:-8}
if [ -s /tmp/ncmoe.json ]; then  # measured by the lease's first call (ggml_cuda_lease.sh NCMOE=1)
  cp /tmp/ncmoe.json $OUT/llama-bench-ncmoe.json
else
  $LC/llama-bench -m "$MODEL" -ngl 99 --n-cpu-moe 24 -t $THREADS -p 36,512 -n 32 -r 2 -o json > $OUT/llama-bench-ncmoe.json 2> $OUT/llama-bench-ncmoe.err
fi
python3 -c "import json,sys; [print('llama.cpp n-cpu-moe', r['n_prompt'], r['n_gen'], round(r['avg_ts'],1)) for r in json.load(open(sys.argv[1]))]" $OUT/llama-bench-ncmoe.json
for run in ${RUNS:-2GiB:upload 1GiB:upload 2GiB:host}; do
  tier=${run%%:*} misses=${run##*:}
  echo "== tier $tier, misses $misses"
  python3 benchmarks/ggml_cuda.py speed "$MODEL" --gpu-tier $tier --tier-misses $misses --prompts 36,512 \
    --tokens 32 --threads $THREADS --repeats 2 --compare ${COMPARE:-0} > $OUT/tier-$tier-$misses.log 2>&1
  grep -v '^moestream' $OUT/tier-$tier-$misses.log | tail -4
done
