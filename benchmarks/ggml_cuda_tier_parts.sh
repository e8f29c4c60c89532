#!/usr/bin/env bash
# Issue 31 item 5 on the GPU machine (run from the repository root there, `.gpu/` carried; the 24 x 128
# synthetic at $MODEL, written by an earlier call of the lease): llama.cpp with every expert on the CPU
# (-ngl 99 --n-cpu-moe 24 -t $THREADS) against moestream's GPU tier, each run's decode step by part
# (`decode_ms_per_step`: the graphs' runs, the backend's waits, issuing copies, the CPU's misses, the
# step's Python). RUNS: tier:way (way: upload, host, split, auto), most important first; no run starts
# after BUDGET seconds. OVERLAP: copies:cpu entries (e.g. "4:4 3:5"), each a run of benchmarks/tier_overlap.py
# first (a layer's copies and CPU misses alone and together, as the way split runs them). Outputs under $OUT
# (tier-*.log, overlap-*.log). (At 62cfa63 it also took a repacked copy's and
# a compute thread's switches: both measured slower, both removed.)
set -uo pipefail
export NATIVE_CPU=${NATIVE_CPU-1}
. benchmarks/ggml_cuda_env.sh || exit 1
ncmoe_baseline
for oc in ${OVERLAP:-}; do
  IFS=: read -r copies cpu <<< "$oc"
  timeout 120 python3 benchmarks/tier_overlap.py "$MODEL" --gpu-tier 2GiB --copies $copies --cpu $cpu \
    --threads $THREADS > $OUT/overlap-$copies-$cpu.log 2>&1
  echo "== overlap $oc (rc $?)"; tail -1 $OUT/overlap-$copies-$cpu.log | cut -c1-600
done
for run in ${RUNS:-2GiB:host 2GiB:upload 2GiB:auto 1GiB:auto}; do
  [ $SECONDS -gt ${BUDGET:-480} ] && { echo "== $run: not started (BUDGET)"; continue; }
  IFS=: read -r tier way <<< "$run"
  log=$OUT/tier-$tier-$way.log
  timeout ${RUN_LIMIT:-150} python3 benchmarks/ggml_cuda.py speed "$MODEL" --gpu-tier $tier --tier-misses $way \
    --prompts ${PROMPTS:-36} --tokens 32 --threads $THREADS --repeats 2 --compare 0 > $log 2>&1
  echo "== $run (rc $?)"; grep '^moestream' $log | grep -o 'GPU tier[^|]*' | head -1; grep -v '^moestream' $log | tail -1 | cut -c1-1000
done
