#!/usr/bin/env bash
# Build llama.cpp's llama-server (CPU only) from the llama-cpp-python source distribution on PyPI,
# which vendors llama.cpp with its tools and convert_hf_to_gguf.py. Everything happens in a scratch
# directory outside the repository; nothing of llama.cpp is committed.
#
#   bash benchmarks/llamacpp/build.sh            # -> prints the llama.cpp source dir and the server binary
#   SCRATCH=/var/tmp/llamacpp VERSION=0.3.16 JOBS=2 bash benchmarks/llamacpp/build.sh
set -euo pipefail

SCRATCH=${SCRATCH:-/var/tmp/llamacpp}
VERSION=${VERSION:-}            # empty: the newest sdist on PyPI
JOBS=${JOBS:-2}
PY=${PY:-python3}

mkdir -p "$SCRATCH"
cd "$SCRATCH"
if ! compgen -G "llama_cpp_python-*.tar.gz" >/dev/null; then
    "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python${VERSION:+==$VERSION}" -d .
fi
sdist=$(ls llama_cpp_python-*.tar.gz | sort -V | tail -1)
src="$SCRATCH/${sdist%.tar.gz}"
[ -d "$src" ] || tar xzf "$sdist"
llama="$src/vendor/llama.cpp"
[ -f "$llama/CMakeLists.txt" ] || { echo "no vendored llama.cpp in $sdist" >&2; exit 1; }

cd "$llama"
# GGML_NATIVE: -march=native (AVX-512 BF16 here); no CURL (no downloads), static libraries, no tests.
cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON \
      -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
      -DBUILD_SHARED_LIBS=OFF >"$SCRATCH/cmake-configure.log" 2>&1 \
    || { tail -40 "$SCRATCH/cmake-configure.log" >&2; exit 1; }
cmake --build build --target llama-server -j "$JOBS" >"$SCRATCH/cmake-build.log" 2>&1 \
    || { tail -40 "$SCRATCH/cmake-build.log" >&2; exit 1; }
echo "llama.cpp source: $llama"
echo "llama-server:     $llama/build/bin/llama-server"
"$llama/build/bin/llama-server" --version 2>&1 | head -3 || true
