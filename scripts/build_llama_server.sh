#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` and `llama-quantize` for `batchlm-bench peers-served`, from the
# llama.cpp sources vendored in the llama-cpp-python sdist (the same llama.cpp the `peers` extra compiles).
# Cached: a second run with the binaries present does nothing (~10-20 min the first time on 2 cores).
#
# Usage: scripts/build_llama_server.sh [DEST]   (default: .cache/peers/llama.cpp)
# Leaves DEST/bin/llama-server and DEST/bin/llama-quantize.
#
# Environment:
#   LLAMA_CPP_PYTHON_VERSION  the sdist whose vendored llama.cpp is built (default: 0.3.36)
#   JOBS                      parallel compile jobs (default: the number of CPUs)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${1:-$root/.cache/peers/llama.cpp}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
jobs="${JOBS:-$(nproc)}"
pip="$root/.venv/bin/pip"

log() { printf '[build_llama_server] %s\n' "$*" >&2; }

stamp="$dest/bin/.built-from"
if [[ -x "$dest/bin/llama-server" && -x "$dest/bin/llama-quantize" && -f "$stamp" \
      && "$(cat "$stamp")" == "llama-cpp-python==$version" ]]; then
  log "llama-server and llama-quantize from llama-cpp-python==$version already in $dest/bin"
  exit 0
fi

mkdir -p "$dest/src"
sdist="$dest/src/llama_cpp_python-$version.tar.gz"
if [[ ! -f "$sdist" ]]; then
  log "downloading the llama-cpp-python==$version sdist"
  "$pip" download -q --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$dest/src"
fi
src="$dest/src/llama_cpp_python-$version/vendor/llama.cpp"
if [[ ! -f "$src/CMakeLists.txt" ]]; then
  tar -xzf "$sdist" -C "$dest/src"
fi

# NOTE: no web UI (the prebuilt one is fetched from the network), no HTTPS, static libraries so the two
# binaries run from anywhere; native CPU flags, as llama-cpp-python's own build does on this machine.
log "configuring llama.cpp (cmake, Release, native CPU)"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$src" -B "$dest/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF >/dev/null
log "building llama-server and llama-quantize with $jobs jobs"
cmake --build "$dest/build" --target llama-server llama-quantize -j "$jobs"
mkdir -p "$dest/bin"
cp "$dest/build/bin/llama-server" "$dest/build/bin/llama-quantize" "$dest/bin/"
echo "llama-cpp-python==$version" >"$stamp"
log "built $dest/bin/llama-server and $dest/bin/llama-quantize"
