"""The layouts heads/interop writes and reads, and the names of their weight files (the
package docstring, heads/interop/__init__.py, describes each)."""

from __future__ import annotations

FORMATS = ("native", "eagle3", "eagle", "medusa", "medusa_fd", "dflash", "speculators")
READ_FORMATS = (*FORMATS, "deepspec")  # what detect_format names and import_draft reads
# The engine releases each layout was checked against (also written into config.json).
ENGINE_VERSIONS = {
    "eagle3": {"vllm": "0.33", "sglang": "0.5.23"},
    "eagle": {"vllm": "0.33", "sglang": "0.5.23"},
    "medusa": {"vllm": "0.32"},
    "medusa_fd": {"FasterDecoding/Medusa": "main"},
    "dflash": {"z-lab/dflash": "44947fb", "llama.cpp": "11434"},
    "speculators": {"vllm-project/speculators": "c05b95b"},
}
WEIGHTS_NAME = "model.safetensors"
MEDUSA_FD_WEIGHTS = "medusa_lm_head.safetensors"  # what FasterDecoding's train.py and TGI use
WEIGHT_FILES = (WEIGHTS_NAME, MEDUSA_FD_WEIGHTS, "pytorch_model.bin", "medusa_lm_head.pt")
