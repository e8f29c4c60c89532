#!/usr/bin/env bash
# Issue 31's measurements in one call of the GPU machine (under its 10-minute limit): the lease script
# (tiny models' check while the 24 x 128 synthetic is written, llama-bench -ngl 99 and --n-cpu-moe 24,
# moestream with every expert on the device), then the GPU tier against --n-cpu-moe (the tier script:
# its three ways of a miss at 2 GiB; `auto` and 1 GiB by the tier script alone, a second call).
set -uo pipefail
NCMOE=1 NCMOE_BEFORE=${NCMOE_BEFORE:-520} bash benchmarks/ggml_cuda_lease.sh
RUNS=${TIER_RUNS:-2GiB:upload 2GiB:split 2GiB:host} bash benchmarks/ggml_cuda_tier_lease.sh
# and, while the call has time left, the experts streamed from disk under a 5 GiB host cache
[ $SECONDS -lt ${STREAM_BEFORE:-480} ] && RUNS=${STREAM_RUNS:-5GiB:2GiB:upload} CEILING=5 bash benchmarks/ggml_cuda_stream_lease.sh
true
