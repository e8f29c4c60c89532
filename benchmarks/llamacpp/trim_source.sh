#!/usr/bin/env bash
# llama.cpp's source as the llama-cpp-python sdist vendors it (the same ggml as `make native`), trimmed for
# carrying to the GPU machine beside the wheels (its 64 MiB a call):
#   bash benchmarks/llamacpp/trim_source.sh SDIST.tar.gz OUT.tar.xz           # 7 MB: what a CPU
#       llama-server and ggml build from (no docs, vocab models, media, other backends):
#       benchmarks/batch_native_lease.sh builds both engines from it
#   bash benchmarks/llamacpp/trim_source.sh --ggml SDIST.tar.gz OUT.tar.xz    # 1.9 MB: what ggml's CPU
#       library builds from on x86 (`python -m moestream.ggml.build --source`), NATIVE_CPU=1 in
#       ggml_cuda_env.sh (beside llama.cpp's CUDA build and .gpu/whl, not also .gpu/srvwhl: the device's
#       64 MiB refused both and the tree: 63.9 MiB in bytes, 64.8 in disk blocks, which it seems to count)
set -euo pipefail
only_ggml=; [ "${1:-}" = --ggml ] && { only_ggml=1; shift; }
sdist=$(realpath "$1"); out=$(realpath -m "$2")
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
tar xzf "$sdist" -C "$work" --wildcards '*/vendor/llama.cpp/*'
src=$(ls -d "$work"/*/vendor/llama.cpp)
cd "$src"
if [ -n "$only_ggml" ]; then
  keep="CMakeLists.txt cmake ggml src include common vendor licenses LICENSE app"
  find . -mindepth 1 -maxdepth 1 $(for k in $keep; do printf -- '-not -name %s ' "$k"; done) -exec rm -rf {} +
  # the CPU library alone, for x86: no CUDA, RPC or virtual-GPU backend, no other CPU's kernels
  rm -rf ggml/src/ggml-{cuda,rpc,virtgpu} ggml/src/ggml-cpu/{spacemit,kleidiai}
  for a in arm loongarch powerpc riscv s390 wasm; do rm -rf ggml/src/ggml-cpu/arch/$a; done
else
  rm -rf docs models media benches pocs skills gguf-py/tests
fi
for b in webgpu et metal hexagon sycl vulkan opencl cann musa hip zdnn openvino; do rm -rf ggml/src/ggml-$b; done
cd .. && tar cJf "$out" llama.cpp
ls -la "$out"
