#!/usr/bin/env bash
# llama.cpp's source as the llama-cpp-python sdist vendors it (the same ggml as `make native`), trimmed to
# what a CPU llama-server and ggml's CPU and CUDA backends build from (no docs, vocab models, tests, media,
# other backends): 7 MB of tar.xz instead of the sdist's 77 MB, small enough to carry to the GPU machine
# beside the wheels (benchmarks/batch_native_lease.sh builds both engines there from it).
#   bash benchmarks/llamacpp/trim_source.sh SDIST.tar.gz OUT.tar.xz
set -euo pipefail
sdist=$(realpath "$1"); out=$(realpath -m "$2")
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
tar xzf "$sdist" -C "$work" --wildcards '*/vendor/llama.cpp/*'
src=$(ls -d "$work"/*/vendor/llama.cpp)
cd "$src"
rm -rf docs models media benches pocs skills gguf-py/tests
for b in webgpu et metal hexagon sycl vulkan opencl cann musa hip zdnn openvino; do rm -rf ggml/src/ggml-$b; done
cd .. && tar cJf "$out" llama.cpp
ls -la "$out"
