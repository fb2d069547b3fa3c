"""Export draft heads to the folders serving engines load, and import such folders back.

Formats (`FORMATS`), each a folder with `config.json` and one weights file:
- `native`: draftsmith's own folder (`save_pretrained`), any head.
- `eagle3`: an EAGLE-3 draft for vLLM (`--speculative-config '{"method":"eagle3","model":DIR,
  "num_speculative_tokens":K}'`) and SGLang (`--speculative-algorithm EAGLE3
  --speculative-draft-model-path DIR`): `LlamaForCausalLMEagle3`, unprefixed `fc`, `layers.0.*`,
  `norm`, `lm_head` [D, H], `d2t`, `t2d`; no `embed_tokens` (the engines use the target's).
- `eagle`: an EAGLE-1/2 draft for the engines' EAGLE-1 Llama classes: `fc` (with bias) and
  `layers.0.*` without input_layernorm (both engines replace it by the identity). Architectures
  `[LlamaForCausalLMEagle, LlamaForCausalLM]`: SGLang takes the first, and vLLM renames each to
  `Eagle{arch}` and takes the first it knows, `EagleLlamaForCausalLM`.
- `medusa`: vLLM's `MedusaModel` (vllm/model_executor/models/medusa.py, last in vLLM 0.32.x):
  `blocks.{h}.layers.{l}`, `lm_heads.{h}`, and `token_map` for a reduced vocabulary.
- `medusa_fd`: FasterDecoding/Medusa's `medusa_lm_head` layout (also what text-generation-inference
  and TensorRT-LLM read): `{h}.{l}.linear.*` residual blocks, `{h}.{num_layers}.weight`, in
  `medusa_lm_head.safetensors` (FasterDecoding's own MedusaModel.from_pretrained reads a torch.save
  of the same dict, `medusa_lm_head.pt`).

- `dflash`: a DFlash draft in z-lab's layout (`DFlashDraftModel`), which vLLM (`"method":
  "dflash"`), SGLang (`--speculative-algorithm DFLASH`) and llama.cpp's converter read: Qwen3
  keys plus `block_size`, `num_target_layers`, `dflash_config`; unprefixed `layers.*`, `fc`,
  `hidden_norm`, `norm`, and `mask_embedding.pt` for a learned MASK vector
  (heads/interop/dflash.py).
- `speculators`: a DFlash draft as vllm-project/speculators saves it (`DFlashSpeculator`), a
  DSpark one (`DSparkSpeculator`), and an EAGLE-3 one (`Eagle3Speculator`, with EAGLE-3.1's
  `fc_norm` / `norm_output`; heads/interop/eagle3.py).
- `deepspec` (read only): deepseek-ai/DeepSpec's `Qwen3DSparkModel` checkpoints, DSpark and its
  anchor-sampled DFlash, imported as DSparkHeads (heads/interop/deepspec.py).

`import_draft` reads any of these (and SafeAILab / SpecForge EAGLE checkpoints: `midlayer.*`,
`pytorch_model.bin`, a `model.` prefix) into our head classes, onto a given target.
Medusa-2 heads adapt the target with LoRA, which no engine applies: only `native` is offered.

The package: `formats.py` names the layouts, `export.py` writes them, `load.py` reads them
back (`checks.py`: the refusals every reader shares; `dflash.py`, `deepspec.py`: DFlash/DSpark).
"""

from __future__ import annotations

from heads.interop.export import (
    engine_default_aux_layers,
    export_draft,
    export_notes,
    formats_for,
    serve_commands,
)
from heads.interop.formats import (
    ENGINE_VERSIONS,
    FORMATS,
    MEDUSA_FD_WEIGHTS,
    READ_FORMATS,
    WEIGHT_FILES,
    WEIGHTS_NAME,
)
from heads.interop.load import (
    detect_format,
    import_draft,
    load_tensors,
    read_config,
    weights_file,
)

__all__ = [
    "ENGINE_VERSIONS",
    "FORMATS",
    "READ_FORMATS",
    "MEDUSA_FD_WEIGHTS",
    "WEIGHTS_NAME",
    "WEIGHT_FILES",
    "detect_format",
    "engine_default_aux_layers",
    "export_draft",
    "export_notes",
    "formats_for",
    "import_draft",
    "load_tensors",
    "read_config",
    "serve_commands",
    "weights_file",
]
