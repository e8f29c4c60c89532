#!/usr/bin/env bash
# The kernels of decoded tokens, llama.cpp -ngl 99 against moestream with every expert on the GPU, timed by
# Nsight Compute (ncu: each kernel's duration only, no counter sets, clocks left alone): per kernel name,
# launches and their time over 8 decoded tokens (llama-bench -p 0 -n 8; moestream a 36-token prompt, then
# 8 tokens, the first 2600 launches: its prefill's and about 3 decoded tokens'; told apart by name and
# count; unbounded, ncu's replay of the whole run passed 110 s on 12-06). Run from the repository root on
# the GPU machine, `.gpu/` carried, after ggml_cuda_lease.sh wrote $MODEL (else written here). Outputs under $OUT
# (ncu-llama.csv, ncu-moestream.csv); `python3 benchmarks/ncu_kernels.py A.csv B.csv` compares them.
set -uo pipefail
. benchmarks/ggml_cuda_env.sh || exit 1
synth_model || { tail -5 $OUT/synth.log; exit 1; }
NCU="ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base"
timeout ${NCU_S:-250} $NCU $LC/llama-bench -m "$MODEL" -ngl 99 -p 0 -n 8 -r 1 --no-warmup \
  > $OUT/ncu-llama.csv 2> $OUT/ncu-llama.err || tail -3 $OUT/ncu-llama.err
timeout ${NCU_S:-250} $NCU --launch-count ${LAUNCHES:-2600} python3 benchmarks/ggml_cuda.py speed "$MODEL" \
  --prompts 36 --tokens 8 --warmup 0 --repeats 1 --compare 0 > $OUT/ncu-moestream.csv 2> $OUT/ncu-moestream.err || tail -3 $OUT/ncu-moestream.err
python3 benchmarks/ncu_kernels.py $OUT/ncu-llama.csv $OUT/ncu-moestream.csv
