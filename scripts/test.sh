#!/usr/bin/env bash
# The README's test command: set-up (idempotent), lint, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
python -m pytest -q "$@"
