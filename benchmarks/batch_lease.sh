#!/usr/bin/env bash
# A lease call for issue 33 (run from the repository root on the GPU machine, `.gpu/` carried, after
# ggml_cuda_lease.sh left the 24 x 128 Q4_K_M synthetic in /tmp, else written here): the machine as a
# 16-core CPU (CUDA_VISIBLE_DEVICES=, ggml's CPU library of ../shared/h200 for both engines):
# llama-server -np 4 against moestream serve -np 4 at 1 and 4 concurrent streams, every expert in RAM
# (benchmarks/batch_servers.py), then moestream's engine alone at 1, 2, 4 and 8 streams, every expert in
# RAM and streamed from disk under a 2 GiB expert cache: aggregate decode and expert bytes read per
# generated token (benchmarks/batch.py). Outputs under $OUT (batch_servers.json, logs, batch.log).
set -uo pipefail
. benchmarks/ggml_cuda_env.sh || exit 1
export CUDA_VISIBLE_DEVICES=
THREADS=${BATCH_THREADS:-16}
nproc; free -g | head -2
synth_model || { tail -5 $OUT/synth.log; exit 1; }
python3 benchmarks/compute_threads.py "$MODEL" $THREADS 2>&1 | grep -v '^moestream' | cut -c1-120
python3 benchmarks/batch_servers.py "$MODEL" --llama-server $LC/llama-server --threads $THREADS \
  --streams ${STREAMS:-1,4} --tokens ${TOKENS:-64} --reps ${REPS:-2} --out $OUT/batch_servers.json 2>&1 | tail -20
[ $SECONDS -lt ${ENGINE_BEFORE:-420} ] && python3 benchmarks/batch.py "$MODEL" --threads $THREADS --streams 1,2,4,8 \
  --tokens 32 --budgets ${BUDGETS:-12GiB,2GiB} --reps 1 --exact 0 2>&1 | tee $OUT/batch.log | grep -v '^moestream' | tail -16
true
