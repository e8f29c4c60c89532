#!/usr/bin/env bash
# Issue 31 item 6 against llama.cpp (run from the repository root on the GPU machine, `.gpu/` carried; the
# 24 x 128 Q4_K_M synthetic written unless ggml_cuda_lease.sh left it in /tmp): the experts bigger than
# the RAM given, every engine in the same cgroup memory limit, the page cache dropped before each run
# (benchmarks/llamacpp/side_by_side.py, as the CPU path's streaming comparison): llama.cpp -ngl 99 with
# every routed expert on the CPU (--n-cpu-moe 24) and with 6 layers' experts on the GPU (--n-cpu-moe 18,
# about the VRAM of moestream's 2 GiB tier), streamed by mmap at read-aheads LLAMA_RA; moestream --device cuda (ggml's CUDA
# backend) with a 2 GiB GPU tier over the host cache the limit leaves (auto), with and without --prefetch,
# then over HOST (3GiB), with and without it (12-07 on the 12-layer file: llama.cpp's best read-ahead was 128 KiB). LIMIT
# (5GiB) is chosen so that the model (8.4 GiB) is bigger than the memory limit and the 2 GiB of VRAM
# together: under 7GiB, llama.cpp's 18 layers on the CPU (6.2 GiB) stayed in its page cache and read
# nothing after warm-up (2026-12-06 night), which is item 5's regime, not this one. Outputs under $OUT:
# sbs.tgz (each run's JSON and server log), sbs.log, sbs-table.txt; BUDGET (420 s) is when no further
# run starts; the every-expert-on-the-CPU runs (--n-cpu-moe 24, the slowest) last. A smaller file (MODEL,
# LAYERS) takes its own TIER (2GiB), NCMOE (18: llama.cpp's layers of experts on the CPU, the rest in VRAM
# about as much as TIER), LIMIT and HOST.
set -uo pipefail
. benchmarks/ggml_cuda_env.sh || exit 1
synth_model || { tail -5 $OUT/synth.log; exit 1; }
LIMIT=${LIMIT:-5GiB} HOST=${HOST:-3GiB} T=${T:-8} TIER=${TIER:-2GiB}
# llama.cpp's layers of experts on the CPU beside about TIER of them in VRAM; then all the file's layers
NCMOE=${NCMOE:-18} LAYERS=${LAYERS:-24}
specs=()  # the runs in the order of what matters most, each written as it ends (a BUDGET cut keeps them)
# moestream's host cache as large as the limit leaves (auto: the memory check's largest fit), as llama.cpp's
# page cache takes what the limit leaves (IO: its I/O threads, else the default 4); then HOST given
specs+=("moestream:device=cuda,gpu_cache=$TIER,host_cache=auto,threads=$T,ra=128${IO:+,io_threads=$IO}")
for ra in ${LLAMA_RA:-128 4096}; do  # llama.cpp's mmap at each read-ahead: its best is the baseline
  specs+=("llama:ngl=99,ncmoe=$NCMOE,t=$T,ra=$ra")
done
# the auto cache with the next layer's experts read ahead (--prefetch on), then HOST with and without it
specs+=("moestream:device=cuda,gpu_cache=$TIER,host_cache=auto,threads=$T,ra=128,prefetch=on${IO:+,io_threads=$IO}")
specs+=("moestream:device=cuda,gpu_cache=$TIER,host_cache=$HOST,threads=$T,ra=128${IO:+,io_threads=$IO}")
specs+=("moestream:device=cuda,gpu_cache=$TIER,host_cache=$HOST,threads=$T,ra=128,prefetch=on${IO:+,io_threads=$IO}")
for ra in ${LLAMA_RA:-128 4096}; do
  specs+=("llama:ngl=99,ncmoe=$LAYERS,t=$T,ra=$ra")
done
for spec in "${specs[@]}"; do  # one process a run, so that the call's budget cuts between runs, not in one
  [ $SECONDS -lt ${BUDGET:-420} ] || { echo "budget: $spec not run"; continue; }
  echo "== $spec (T=$SECONDS)"
  python3 benchmarks/llamacpp/side_by_side.py run "$spec" --llama-server $LC/llama-server --gguf "$MODEL" \
    --model "$MODEL" --memory-limit $LIMIT --max-tokens ${TOKENS:-32} --out $OUT/sbs >> $OUT/sbs.log 2>&1
  tail -3 $OUT/sbs.log
done
python3 benchmarks/llamacpp/side_by_side.py table --out $OUT/sbs 2>&1 | tee $OUT/sbs-table.txt | tail -20
# the runs' folders are named by their specs ('=' and ',': not names that come back from the machine)
tar czf $OUT/sbs.tgz -C $OUT sbs && rm -rf $OUT/sbs
