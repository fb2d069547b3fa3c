#!/usr/bin/env bash
# The README's main command: set-up (idempotent), then Medusa-1 heads trained on the embedded
# SmolLM2-135M-Instruct. Extra arguments are Hydra overrides, e.g. trainer.max_steps=3.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python train.py +experiment=medusa_llama "$@"
