"""OpenVINO IR folders that OpenVINO GenAI serves: a target and its EAGLE-3 draft.

Converted with OpenVINO's own `convert_model` from the torch modules draftsmith already holds
(no optimum-intel, which pins an older transformers). What GenAI 2026.4 expects, read from its
sources (src/cpp/src/speculative_decoding/eagle3_model_transforms.cpp) and checked here:

- **Target** (`openvino_model.xml`): a stateful decoder, inputs `input_ids`, `attention_mask`,
  `position_ids`, `beam_idx`, output `logits`, the KV cache held in variables (ReadValue/Assign)
  behind a `beam_idx` gather. GenAI's CPU pipeline rewrites every sdpa op to paged attention. For
  EAGLE-3 it taps the target itself: for each id in `hidden_layers_list` it takes the first
  residual add whose second input is a MatMul fed by a Multiply (the MLP's down_proj) among ops
  named `layers.{id}/`, i.e. that decoder layer's *output*, HF `hidden_states[id + 1]`.
  draftsmith's `aux_layers` are HF hidden_states indices (a layer's input), so the ids written
  are `aux - 1`; index 0 (the embeddings) has no such add and is refused, as are repeated ids
  (GenAI fills each id with a different op).
- **Draft**: `LlamaForCausalLMEagle3` as optimum-intel traces it: `model.embed_tokens` (GenAI
  swaps in the target's table), `model.fc` (3H -> H; its MatMul on the `hidden_states` input is
  moved into the target after the concat of the three features), one `model.midlayer` (its MLP
  residual add is the draft's own feature, fed back one level deeper), `model.norm`,
  `model.lm_head` (D rows) and `d2t` as an int64 constant output named `d2t` (offsets: target id
  = draft id + d2t[draft id], draftsmith's own convention). rt_info `eagle3_mode` and
  `hidden_layers_list` make GenAI run it as EAGLE-3 with our layers (its default,
  [2, N/2, N-3] as layer outputs, is not draftsmith's, and it needs N >= 10).
- Both attend with a 4-D mask built from the 2-D one and grouped-query heads expanded by a
  repeat. torch sdpa's `enable_gqa` converts to gathers that hide the cache from the
  paged-attention rewrite, which then fails with "Model references undeclared parameters".

Weights are written in f32 (exact against the harness) or f16 (half the disk; CPU decompresses
them at load); a target also in int8 or int4 weight-only compression (openvino_weights.py), the
types OpenVINO users serve on CPUs. Folders are written atomically; `openvino_target_dir` caches
a target's per weight type.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from data.errors import ConfigError, DraftsmithError
from heads.base import atomic_save_dir
from heads.draft_layer import DraftDecoderLayer
from heads.eagle3 import Eagle3Head
from heads.interop.openvino_weights import COMPRESSED_TYPES, compress_weights

MODEL_XML = "openvino_model.xml"
WEIGHT_TYPES = ("f32", "f16", "int8", "int4")  # int8/int4: weight-only (openvino_weights.py)
DRAFT_WEIGHT_TYPES = ("f32", "f16")
EXPORT_VERSION = 1  # bump when the IR layout changes: cached target folders are rebuilt
_EXAMPLE_PAST, _EXAMPLE_NEW = 3, 2  # traced shapes (every dimension stays dynamic)
# head switches GenAI's EAGLE-3 graph has no step for (a norm per fused layer before fc; the
# post-norm state fed back)
_UNSERVED_SWITCHES = ("fc_norm", "norm_output")


def require_openvino(genai: bool = False):
    """The `openvino` module (with `genai`: openvino_genai and openvino_tokenizers importable
    too), or a one-line error naming the install."""
    import importlib

    names = ("openvino", "openvino_genai", "openvino_tokenizers") if genai else ("openvino",)
    try:
        modules = [importlib.import_module(name) for name in names]
    except ImportError as exc:
        raise DraftsmithError(
            f"OpenVINO is not installed ({exc.name or exc}): pip install -e '.[openvino]' "
            "(scripts/setup.sh does)."
        ) from exc
    return modules[0]


def genai_layer_ids(aux_layers: list[int], num_layers: int) -> list[int]:
    """GenAI's `hidden_layers_list` for draftsmith's aux_layers (HF hidden_states indices)."""
    aux = [int(i) for i in aux_layers]
    if len(aux) != 3:
        raise ConfigError(
            f"head.aux_layers={aux}: OpenVINO GenAI's EAGLE-3 fuses exactly 3 target layers."
        )
    if len(set(aux)) != 3:
        raise ConfigError(
            f"head.aux_layers={aux}: OpenVINO GenAI taps each layer once; use 3 distinct layers."
        )
    if not all(1 <= i < num_layers for i in aux):
        raise ConfigError(
            f"head.aux_layers={aux}: OpenVINO GenAI reads a decoder layer's output, so each index "
            f"must lie in [1, {num_layers - 1}] (0, the embeddings, is not a layer's output)."
        )
    return [i - 1 for i in aux]


# ---- tracing modules ---------------------------------------------------------------------


def _attention_mask(attention_mask: Tensor, new: int) -> Tensor:
    """(B, S) 0/1 -> (B, 1, new, S) bool: row i sees keys <= its position, padding excluded."""
    total = attention_mask.shape[1]
    rows = torch.arange(new) + (total - new)
    causal = torch.arange(total)[None, :] <= rows[:, None]
    return causal[None, None] & attention_mask[:, None, None, :].bool()


class _TracedTarget(nn.Module):
    """(input_ids, attention_mask, position_ids, past) -> (logits, k0, v0, k1, v1, ...)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"  # 5.24 renamed it

    def forward(self, input_ids, attention_mask, position_ids, past):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        # Filled directly: a first `update` concatenates onto an empty rank-1 tensor, which
        # OpenVINO's converter cannot type.
        for layer, (keys, values) in zip(cache.layers, past):
            layer.keys, layer.values, layer.device, layer.is_initialized = (
                keys,
                values,
                keys.device,
                True,
            )
        mask = _attention_mask(attention_mask, input_ids.shape[1])
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            **{self.cache_arg: cache},
        )
        flat = []
        for layer in cache.layers:
            flat += [layer.keys, layer.values]
        return (out.logits, *flat)


def _expand_heads(x: Tensor, groups: int) -> Tensor:
    """(B, kv, S, d) -> (B, kv * groups, S, d), each kv head repeated for its query heads."""
    B, kv, S, d = x.shape
    return x[:, :, None].expand(B, kv, groups, S, d).reshape(B, kv * groups, S, d)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class _MidLayer(nn.Module):
    """The draft's decoder layer (the same parameters) as GenAI finds it, named `midlayer`."""

    def __init__(self, layer: DraftDecoderLayer):
        super().__init__()
        self.input_layernorm, self.hidden_norm = layer.input_layernorm, layer.hidden_norm
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.post_attention_layernorm = layer.post_attention_layernorm

    def forward(self, hidden, embeds, position_ids, past_keys, past_values, mask):
        B, q, _ = hidden.shape
        attn = self.self_attn
        d = attn.spec.head_dim
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        qs = attn.q_proj(x).view(B, q, -1, d).transpose(1, 2)  # (B, nh, q, d)
        ks = attn.k_proj(x).view(B, q, -1, d).transpose(1, 2)  # (B, kv, q, d)
        vs = attn.v_proj(x).view(B, q, -1, d).transpose(1, 2)
        cos, sin = attn.rotary(vs, position_ids)
        cos, sin = cos[:, None], sin[:, None]
        keys = torch.cat([past_keys, _rotate(ks, cos, sin)], dim=2)
        values = torch.cat([past_values, vs], dim=2)
        groups = qs.shape[1] // keys.shape[1]
        out = F.scaled_dot_product_attention(
            _rotate(qs, cos, sin),
            _expand_heads(keys, groups),
            _expand_heads(values, groups),
            attn_mask=mask,
        )
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(B, q, -1))
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), keys, values


class _Eagle3Modules(nn.Module):
    def __init__(self, head: Eagle3Head):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(head.embed_weight.detach().float())
        self.fc, self.midlayer = head.fc, _MidLayer(head.layers[0])
        self.norm, self.lm_head = head.norm, head.lm_head
        self.register_buffer("d2t", head.d2t.detach().clone())


class _TracedEagle3(nn.Module):
    """(input_ids, attention_mask, position_ids, hidden_states (B, q, 3H), past) ->
    (logits (B, q, D), keys, values, d2t)."""

    def __init__(self, head: Eagle3Head):
        super().__init__()
        self.model = _Eagle3Modules(head)

    def forward(self, input_ids, attention_mask, position_ids, hidden_states, past):
        m = self.model
        mask = _attention_mask(attention_mask, input_ids.shape[1])
        hidden, keys, values = m.midlayer(
            m.fc(hidden_states), m.embed_tokens(input_ids), position_ids, *past[0], mask
        )
        return m.lm_head(m.norm(hidden)), keys, values, m.d2t


# ---- conversion --------------------------------------------------------------------------


def _kv_names(layers: int, prefix: str) -> list[str]:
    return [f"{prefix}.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]


def _convert(module: nn.Module, example: tuple, inputs: list[str], outputs: list[str]):
    """Trace `module` into an ov.Model whose ports carry the given names, in order."""
    ov = require_openvino()
    with torch.no_grad(), warnings.catch_warnings():
        # transformers' sdpa wrapper branches on shapes; the traced example (2 new tokens after
        # 3 cached) takes the general branch, so its TracerWarnings are expected
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        model = ov.convert_model(module.eval(), example_input=example)
    if len(model.inputs) != len(inputs) or len(model.outputs) != len(outputs):
        raise RuntimeError(
            f"traced {len(model.inputs)} inputs / {len(model.outputs)} outputs, expected "
            f"{len(inputs)} / {len(outputs)}: an input went unused or was folded away."
        )
    for port, name in zip(model.inputs, inputs):
        port.get_tensor().set_names({name})
        port.get_node().set_friendly_name(name)
    for port, name in zip(model.outputs, outputs):
        port.get_tensor().set_names({name})
    return model


def _make_stateful(model, layers: int) -> None:
    """Hide the KV inputs/outputs in variables behind a `beam_idx` gather (the layout GenAI and
    optimum-intel use); each variable starts as zeros [batch, kv_heads, 0, head_dim]."""
    ov = require_openvino()
    from openvino import opset13 as ops
    from openvino._offline_transformations import apply_make_stateful_transformation

    past, present = _kv_names(layers, "past_key_values"), _kv_names(layers, "present")
    beam = ops.parameter(ov.PartialShape([-1]), ov.Type.i32, name="beam_idx")
    beam.output(0).get_tensor().set_names({"beam_idx"})
    model.add_parameters([beam])
    for name in past:
        port = model.input(name)
        readers = port.get_target_inputs()
        gathered = ops.gather(port, beam, ops.constant(0))
        for reader in readers:
            reader.replace_source_output(gathered.output(0))
    model.validate_nodes_and_infer_types()
    apply_make_stateful_transformation(model, dict(zip(past, present)))
    ids = model.input("input_ids")
    batch = ops.gather(ops.shape_of(ids, output_type="i64"), ops.constant([0]), ops.constant(0))
    for op in model.get_ops():
        if op.get_type_name() == "ReadValue":
            dims = [d.min_length for d in op.get_output_partial_shape(0)]
            shape = [batch] + [ops.constant(np.array([d], dtype=np.int64)) for d in dims[1:]]
            zero = ops.constant(0.0, dtype=op.get_output_element_type(0))
            op.set_arguments([ops.broadcast(zero, ops.concat(shape, 0))])
    model.validate_nodes_and_infer_types()


def _example_past(layers: int, kv_heads: int, head_dim: int) -> list[tuple[Tensor, Tensor]]:
    shape = (1, kv_heads, _EXAMPLE_PAST, head_dim)
    return [(torch.randn(shape), torch.randn(shape)) for _ in range(layers)]


def _example_tokens() -> tuple[Tensor, Tensor, Tensor]:
    total = _EXAMPLE_PAST + _EXAMPLE_NEW
    ids = torch.tensor([[5] * _EXAMPLE_NEW])
    positions = torch.arange(_EXAMPLE_PAST, total)[None]
    return ids, torch.ones(1, total, dtype=torch.long), positions


def _save(model, folder: Path, weights: str) -> None:
    ov = require_openvino()
    if weights not in WEIGHT_TYPES:
        raise ConfigError(f"openvino weights={weights!r}: use one of {', '.join(WEIGHT_TYPES)}.")
    if weights in COMPRESSED_TYPES:
        compress_weights(model, weights)
    ov.save_model(model, folder / MODEL_XML, compress_to_fp16=weights == "f16")


def _text_config(model: nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def export_openvino_target(target, out_dir, weights: str = "f32", tokenizer: bool = True) -> Path:
    """`target` (heads.target.Target, sdpa attention) as a GenAI model folder: the stateful IR,
    config.json, generation_config.json and, with `tokenizer`, openvino_tokenizer.xml /
    openvino_detokenizer.xml (openvino_tokenizers)."""
    model = target.model
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32:
        raise ConfigError(
            f"the target is loaded in {dtype}; export it to OpenVINO from float32 "
            "(model.dtype=float32; weights=f16 halves the files instead)."
        )
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "sdpa":
        raise ConfigError(
            f"the target uses attn_implementation={impl!r}; OpenVINO GenAI pages sdpa "
            "attention only: load it with model.attn_implementation=sdpa."
        )
    cfg = _text_config(model)
    layers = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    example = (*_example_tokens(), _example_past(layers, kv_heads, head_dim))
    names = ["input_ids", "attention_mask", "position_ids", *_kv_names(layers, "past_key_values")]
    outputs = ["logits", *_kv_names(layers, "present")]
    ov_model = _convert(_TracedTarget(model), example, names, outputs)
    _make_stateful(ov_model, layers)
    ov_model.set_rt_info(target.fingerprint, ["draftsmith", "target_fingerprint"])

    def write(tmp: Path) -> None:
        _save(ov_model, tmp, weights)
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer and target.tokenizer is not None:
            _save_tokenizer(target.tokenizer, tmp)

    return atomic_save_dir(out_dir, write)


def _save_tokenizer(hf_tokenizer, folder: Path) -> None:
    ov = require_openvino()
    from openvino_tokenizers import convert_tokenizer

    encoder, decoder = convert_tokenizer(hf_tokenizer, with_detokenizer=True)
    ov.save_model(encoder, folder / "openvino_tokenizer.xml")
    ov.save_model(decoder, folder / "openvino_detokenizer.xml")


def export_openvino_draft(head: Eagle3Head, target, out_dir, weights: str = "f32") -> Path:
    """An EAGLE-3 head (trained on `target`) as a GenAI draft folder: the IR plus the
    `LlamaForCausalLMEagle3` config.json (heads.interop export format `eagle3`)."""
    from heads.interop.export import export_draft

    if not isinstance(head, Eagle3Head):
        raise ConfigError(
            f"OpenVINO GenAI serves EAGLE-3 drafts; this head is {head.method!r}. Train an "
            "eagle3 head, or benchmark this one with the harness or llama.cpp."
        )
    if weights not in DRAFT_WEIGHT_TYPES:
        raise ConfigError(
            f"openvino draft weights={weights!r}: export the draft in f32 or f16 "
            "(openvino.draft_weights); int8/int4 are for the target, whose matmuls dominate."
        )
    layer_ids = genai_layer_ids(head.config.aux_layers, target.num_layers)
    if len(head.layers) != 1:
        raise ConfigError(
            f"head.num_layers={len(head.layers)}: OpenVINO GenAI's EAGLE-3 runs one draft "
            "layer; train with head.num_layers=1, or serve this head in vLLM."
        )
    for switch in _UNSERVED_SWITCHES:  # EAGLE-3.1 options, where a head class has them
        if getattr(head.config, switch, False):
            raise ConfigError(
                f"head.{switch}=true: OpenVINO GenAI's EAGLE-3 moves fc alone into the target "
                "and feeds back the draft layer's pre-norm output, so it cannot serve this "
                f"head; train with head.{switch}=false, or serve it in vLLM."
            )
    spec = head.spec
    ids, mask, positions = _example_tokens()
    fused = torch.randn(1, ids.shape[1], 3 * target.hidden_size)
    past = _example_past(1, spec.num_kv_heads, spec.head_dim)
    names = ["input_ids", "attention_mask", "position_ids", "hidden_states"]
    names += _kv_names(1, "past_key_values")
    traced = _TracedEagle3(copy.deepcopy(head).float())  # GenAI feeds f32 features
    outputs = ["logits", *_kv_names(1, "present"), "d2t"]
    ov_model = _convert(traced, (ids, mask, positions, fused, past), names, outputs)
    ov_model.output("d2t").get_node().input_value(0).get_node().set_friendly_name("d2t")
    _make_stateful(ov_model, 1)
    ov_model.set_rt_info("True", ["eagle3_mode"])
    ov_model.set_rt_info(layer_ids, ["hidden_layers_list"])
    ov_model.set_rt_info(target.fingerprint, ["draftsmith", "target_fingerprint"])

    def write(tmp: Path) -> None:
        _save(ov_model, tmp, weights)
        with tempfile.TemporaryDirectory() as scratch:
            config = export_draft(head, target, "eagle3", Path(scratch) / "eagle3")
        config["draftsmith"]["openvino_hidden_layers_list"] = layer_ids
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    return atomic_save_dir(out_dir, write)


def weights_digest(model: nn.Module) -> str:
    """sha1 of every parameter and buffer (names, shapes, bytes): the cache key of an export
    (a Target's fingerprint samples only signs of its embeddings)."""
    h = hashlib.sha1()
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(data.shape)}:{data.dtype}".encode())
        h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def openvino_target_dir(target, cache_dir, weights: str = "f32") -> Path:
    """The target's GenAI folder under `<cache_dir>/openvino/`, converted once per weights
    digest, weight type and export layout."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(target.name_or_path).name)
    name = f"{safe}-{weights_digest(target.model)}-v{EXPORT_VERSION}-{weights}"
    folder = Path(cache_dir).expanduser() / "openvino" / name
    if not (folder / MODEL_XML).is_file():
        export_openvino_target(target, folder, weights)
    return folder
