#!/usr/bin/env bash
# The README's test command: set-up (idempotent), lint, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_vllm.sh  # vLLM's own venv for tests/test_vllm.py (once: 3.1 GB, 78 s here)
. .venv/bin/activate
ruff check .
python -m pytest -q "$@"
