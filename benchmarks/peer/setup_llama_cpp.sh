#!/usr/bin/env bash
# Installs llama.cpp (llama-cpp-python, built from its source distribution for this CPU) in its own venv, for
# benchmarks/generation_anchors.py: never a project dependency. Also installs what llama.cpp's own converter
# (vendor/llama.cpp/convert_hf_to_gguf.py of the same source, kept in the venv's share/llama.cpp/) needs to write
# the benchmark's model as an F32 GGUF: its gguf-py, and torch and transformers at the project's CI pins
# (benchmarks/peer/venv.sh). The build takes about 10 minutes on 2 cores and needs cmake and a C++ compiler
# (apt-get install cmake g++).
# Idempotent (a stamp file records the pins it was installed with). Usage: benchmarks/peer/setup_llama_cpp.sh [VENV]
set -u
VENV="${1:-$(cd "$(dirname "$0")/../.." && pwd)/.cache/bench/llama-venv}"
PEER="llama.cpp"
LLAMA_PIN="llama-cpp-python==0.3.36"
# shellcheck source=benchmarks/peer/venv.sh
source "$(dirname "$0")/venv.sh"
WANT="$LLAMA_PIN $SHARED_PINS"
installed_already
command -v cmake >/dev/null && command -v c++ >/dev/null || fail "cmake and a C++ compiler are needed"
make_venv
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install --quiet $SHARED_PINS numpy sentencepiece protobuf >>"$LOG" 2>&1 \
    || fail "pip install $SHARED_PINS"
SOURCE="$(mktemp -d)"
"$VENV/bin/python" -m pip download --quiet --no-deps --no-binary :all: "$LLAMA_PIN" -d "$SOURCE" >>"$LOG" 2>&1 \
    || fail "pip download $LLAMA_PIN"
tar xzf "$SOURCE"/llama_cpp_python-*.tar.gz -C "$SOURCE" || fail "unpack $LLAMA_PIN"
TREE="$(ls -d "$SOURCE"/llama_cpp_python-*/)"
# GGML_NATIVE: compiled for this CPU's instruction set (AVX-512 where it has it), as a user building it would
"$VENV/bin/python" -m pip install --quiet "$TREE" --config-settings=cmake.args="-DGGML_NATIVE=ON" >>"$LOG" 2>&1 \
    || fail "build $LLAMA_PIN"
"$VENV/bin/python" -m pip install --quiet "$TREE/vendor/llama.cpp/gguf-py" >>"$LOG" 2>&1 || fail "install gguf-py"
mkdir -p "$VENV/share/llama.cpp"
cp "$TREE/vendor/llama.cpp/convert_hf_to_gguf.py" "$VENV/share/llama.cpp/" || fail "copy the converter"
cp -r "$TREE/vendor/llama.cpp/conversion" "$VENV/share/llama.cpp/" || fail "copy the converter's package"
"$VENV/bin/python" -c "import llama_cpp, gguf, torch, transformers" >>"$LOG" 2>&1 \
    || fail "llama_cpp (with gguf, torch, transformers) does not import"
rm -rf "$SOURCE"
installed
