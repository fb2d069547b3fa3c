"""heads.interop: export to the folders serving engines load, and import them back, on tiny
random Llama / Qwen2 targets.

The schema tests pin each layout as the engine's loader reads it (the source is named beside each
test); they are written from those loaders, not from the exporter's output.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_llama, make_tokenizer
from safetensors.torch import load_file, save_file

import heads
from heads import interop
from heads.base import HeadMismatchError, TargetInfo
from heads.draft_layer import DraftCache
from heads.eagle import EagleConfig, EagleHead
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.medusa import MedusaConfig, MedusaHeads
from heads.target import Target

V, H = 256, 64
F32, I64, BOOL = torch.float32, torch.int64, torch.bool
# Llama config keys of the draft layer of a tiny Llama target (conftest.make_llama).
LLAMA_KEYS = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "initializer_range": 0.02,
    "num_hidden_layers": 1,
    "vocab_size": 256,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "torch_dtype": "float32",
    "bos_token_id": 2,
    "eos_token_id": 3,
}


def _layer(qkv_in: int) -> dict:
    """layers.0 tensors of the tiny Llama draft layer (q/k/v read `qkv_in` features)."""
    return {
        "layers.0.self_attn.q_proj.weight": (F32, (64, qkv_in)),
        "layers.0.self_attn.k_proj.weight": (F32, (32, qkv_in)),
        "layers.0.self_attn.v_proj.weight": (F32, (32, qkv_in)),
        "layers.0.self_attn.o_proj.weight": (F32, (64, 64)),
        "layers.0.post_attention_layernorm.weight": (F32, (64,)),
        "layers.0.mlp.gate_proj.weight": (F32, (128, 64)),
        "layers.0.mlp.up_proj.weight": (F32, (128, 64)),
        "layers.0.mlp.down_proj.weight": (F32, (64, 128)),
    }


@pytest.fixture
def llama6(tokenizer):
    """Six layers: EAGLE-3's default aux layers [2, 3, 3] are the engines' [2, N//2, N-3]."""
    return Target.from_model(make_llama(layers=6), tokenizer, name_or_path="tiny-llama6")


def _scramble(head, seed=0):
    """Random weights everywhere (fresh Medusa blocks are zero): a round trip must carry them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return head


def _counts():
    return torch.randint(0, 100, (V,), generator=torch.Generator().manual_seed(0))


def _eagle3(target, draft_vocab_size=None, **kw):
    torch.manual_seed(0)
    config = Eagle3Config(draft_vocab_size=draft_vocab_size, **kw)
    return _scramble(Eagle3Head.for_target(config, target, token_counts=_counts()))


def _eagle(target, **kw):
    torch.manual_seed(0)
    return _scramble(EagleHead.for_target(EagleConfig(**kw), target))


def _medusa(target, **kw):
    torch.manual_seed(0)
    return _scramble(MedusaHeads.for_target(MedusaConfig(**kw), target, token_counts=_counts()))


def _files(folder, weights="model.safetensors"):
    """(config.json without the provenance block, that block, {tensor: (dtype, shape)})."""
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / weights))
    assert sorted(p.name for p in folder.iterdir()) == sorted(["config.json", weights])
    shapes = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    return config, config.pop("draftsmith"), shapes, tensors


def _same_tensors(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


def _same_eagle_outputs(a, b):
    """Both heads give the same features, logits and top-4 proposals on random inputs."""
    g = torch.Generator().manual_seed(3)
    tokens, pos = torch.randint(0, V, (2, 7), generator=g), torch.arange(7).expand(2, 7)
    width = len(a.feature_layers() or [0]) * H
    feats = {"aux": torch.randn(2, 7, width, generator=g)}
    feats["hidden"] = feats["aux"][..., :H]
    outs = [h.step(tokens, h.target_hidden(feats), pos, DraftCache()) for h in (a, b)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    top = [h.draft_to_target(o[1].topk(4).indices) for h, o in zip((a, b), outs)]
    assert torch.equal(top[0], top[1])


def _same_medusa_outputs(a, b):
    hidden = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(3))
    la, lb = a(hidden), b(hidden)
    assert torch.equal(la, lb)
    assert torch.equal(a.draft_to_target(la.argmax(-1)), b.draft_to_target(lb.argmax(-1)))


def _round_trip(head, target, fmt, tmp_path):
    interop.export_draft(head, target, fmt, tmp_path / fmt)
    assert interop.detect_format(tmp_path / fmt) == fmt
    back = interop.import_draft(tmp_path / fmt, target)
    assert type(back) is type(head) and back.target_info == TargetInfo.of(target)
    _same_tensors(head, back)
    return back


# ---- schemas ---------------------------------------------------------------------------------


# Source: vLLM 0.33 vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM; registry
# maps LlamaForCausalLMEagle3; "midlayer." renamed to "layers.0.", d2t read as
# draft_id_to_target_id, embed_tokens shared with the target) and SGLang 0.5.23
# python/sglang/srt/models/llama_eagle3.py (LlamaForCausalLMEagle3, layers.0 since PR #24663,
# d2t -> hot_token_id, t2d skipped).
def test_eagle3_schema(llama6, tmp_path):
    head = _eagle3(llama6, draft_vocab_size=50)
    returned = interop.export_draft(head, llama6, "eagle3", tmp_path / "e3")
    config, provenance, shapes, tensors = _files(tmp_path / "e3")
    assert config == {
        "architectures": ["LlamaForCausalLMEagle3"],
        **LLAMA_KEYS,
        "draft_vocab_size": 50,
        "norm_before_residual": False,
        "fc_norm": False,
        "norm_output": False,
    }
    assert returned == {**config, "draftsmith": provenance}
    assert provenance["format"] == "eagle3" and provenance["base_model"] == "tiny-llama6"
    assert provenance["targets"] == {"vllm": "0.33", "sglang": "0.5.23"}
    assert interop.ENGINE_VERSIONS["eagle3"] == provenance["targets"]
    assert shapes == {
        "fc.weight": (F32, (64, 192)),
        "layers.0.input_layernorm.weight": (F32, (64,)),
        "layers.0.hidden_norm.weight": (F32, (64,)),
        **_layer(128),
        "norm.weight": (F32, (64,)),
        "lm_head.weight": (F32, (50, 64)),
        "d2t": (I64, (50,)),
        "t2d": (BOOL, (256,)),
    }
    ids = torch.arange(50) + tensors["d2t"]  # target id = draft id + d2t[draft id]
    assert torch.equal(ids, head.draft_to_target(torch.arange(50)))
    assert torch.equal(tensors["t2d"].nonzero()[:, 0], ids)


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_eagle3_full_vocab_writes_no_maps(llama6, tmp_path, fmt):
    """A draft over the whole vocabulary has the identity map: written as no d2t / t2d, since
    vLLM builds no draft_id_to_target_id for it and refuses a checkpoint that has one; the
    importer reads their absence as the identity."""
    head = _eagle3(llama6)
    interop.export_draft(head, llama6, fmt, tmp_path / fmt)
    config, _, shapes, _ = _files(tmp_path / fmt)
    assert config["draft_vocab_size"] == V
    assert shapes["lm_head.weight"] == (F32, (V, H))
    assert "d2t" not in shapes and "t2d" not in shapes
    back = interop.import_draft(tmp_path / fmt, llama6)
    assert torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)
    _same_eagle_outputs(head, back)


def test_speculators_names_the_local_verifier_it_is_given(llama6, tmp_path):
    """`vllm serve EXPORT` loads the verifier its config names: the folder the target loaded
    from when the exporter gives one (offline), else the target's recorded name (a Hub id)."""
    head = _eagle3(llama6, draft_vocab_size=50)
    local = tmp_path / "targets" / "tiny"
    config = interop.export_draft(head, llama6, "speculators", tmp_path / "a", verifier=str(local))
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(local)
    assert config["draftsmith"]["base_model"] == "tiny-llama6"  # the provenance keeps the name
    config = interop.export_draft(head, llama6, "speculators", tmp_path / "b")
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-llama6"


# Source: vLLM 0.33 vllm/model_executor/models/llama_eagle.py (EagleLlamaForCausalLM; the EAGLE
# config maps LlamaForCausalLM -> EagleLlamaForCausalLM; layer 0's input_layernorm is an
# identity) and SGLang 0.5.23 python/sglang/srt/models/llama_eagle.py (LlamaForCausalLMEagle,
# fc = nn.Linear(2H, H) with bias, layer 0 without input_layernorm).
def test_eagle_schema(tiny_llama, tmp_path):
    interop.export_draft(_eagle(tiny_llama), tiny_llama, "eagle", tmp_path / "e1")
    config, provenance, shapes, _ = _files(tmp_path / "e1")
    assert config == {"architectures": ["LlamaForCausalLMEagle", "LlamaForCausalLM"], **LLAMA_KEYS}
    assert provenance["format"] == "eagle"
    assert shapes == {"fc.weight": (F32, (64, 128)), "fc.bias": (F32, (64,)), **_layer(64)}


# Source: vLLM 0.32 vllm/model_executor/models/medusa.py (ResidualBlock: x + SiLU(layer(x)) per
# `layers.{l}`, bias = medusa_fc_bias; lm_heads.{h}; token_map scatters the truncated vocab;
# original_lm_head reads lm_heads.0 only) and vllm/transformers_utils/configs/medusa.py.
@pytest.mark.parametrize("share", [False, True])
def test_medusa_schema(tiny_llama, tmp_path, share):
    head = _medusa(tiny_llama, num_heads=3, num_layers=2, draft_vocab_size=40, share_lm_head=share)
    interop.export_draft(head, tiny_llama, "medusa", tmp_path / "m")
    config, provenance, shapes, tensors = _files(tmp_path / "m")
    assert config == {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": 64,
        "vocab_size": 256,
        "num_heads": 3,
        "num_hidden_layers": 2,
        "truncated_vocab_size": 40,
        "original_lm_head": share,
        "medusa_fc_bias": True,
    }
    assert provenance["targets"] == {"vllm": "0.32"}
    blocks = {
        f"blocks.{h}.layers.{i}.{p}": (F32, (64, 64) if p == "weight" else (64,))
        for h in range(3)
        for i in range(2)
        for p in ("weight", "bias")
    }
    lm_heads = {f"lm_heads.{h}.weight": (F32, (40, 64)) for h in range(1 if share else 3)}
    assert shapes == {**blocks, **lm_heads, "token_map": (I64, (40,))}
    assert torch.equal(tensors["token_map"], head.draft_to_target(torch.arange(40)))


# Source: FasterDecoding/Medusa medusa/model/medusa_model.py (MedusaConfig: medusa_num_heads,
# medusa_num_layers, base_model_name_or_path; each head nn.Sequential(ResBlock.linear ...,
# Linear(H, V, bias=False))) and medusa/train/train.py (saves medusa_lm_head.safetensors);
# text-generation-inference server/text_generation_server/layers/medusa.py reads the same names.
@pytest.mark.parametrize("share", [False, True])
def test_medusa_fd_schema(tiny_llama, tmp_path, share):
    head = _medusa(tiny_llama, num_heads=3, num_layers=1, share_lm_head=share)
    interop.export_draft(head, tiny_llama, "medusa_fd", tmp_path / "fd")
    config, provenance, shapes, tensors = _files(tmp_path / "fd", "medusa_lm_head.safetensors")
    assert config == {
        "medusa_num_heads": 3,
        "medusa_num_layers": 1,
        "base_model_name_or_path": "tiny-llama",
    }
    assert provenance["format"] == "medusa_fd"
    assert shapes == {
        name: (F32, shape)
        for h in range(3)
        for name, shape in [
            (f"{h}.0.linear.weight", (64, 64)),
            (f"{h}.0.linear.bias", (64,)),
            (f"{h}.1.weight", (256, 64)),
        ]
    }
    if share:  # copies of the target's rows
        assert torch.equal(tensors["2.1.weight"], tiny_llama.lm_head.weight)


# ---- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("draft_vocab_size", [50, None])
def test_eagle3_round_trip(tiny_target, tmp_path, draft_vocab_size):
    head = _eagle3(tiny_target, draft_vocab_size=draft_vocab_size)
    back = _round_trip(head, tiny_target, "eagle3", tmp_path)
    assert back.config == head.config
    _same_eagle_outputs(head, back)


# Source: speculators PR #610 / #670 (Eagle3SpeculatorConfig fc_norm, norm_output; fc_norm a
# ModuleList of one RMSNorm per aux layer), vLLM llama_eagle3.py (getattr(config, "fc_norm"),
# "norm_output"; PR #42764) and SGLang llama_eagle3.py (config.norm_output).
@pytest.mark.parametrize(("fc_norm", "norm_output"), [(True, False), (False, True), (True, True)])
def test_eagle3_31_switches_export_and_import(llama6, tmp_path, fc_norm, norm_output):
    head = _eagle3(llama6, draft_vocab_size=50, fc_norm=fc_norm, norm_output=norm_output)
    interop.export_draft(head, llama6, "eagle3", tmp_path / "e3")
    config, _, shapes, _ = _files(tmp_path / "e3")
    assert config["fc_norm"] is fc_norm and config["norm_output"] is norm_output
    norms = {f"fc_norm.{i}.weight": (F32, (H,)) for i in range(3)} if fc_norm else {}
    assert {k: v for k, v in shapes.items() if k.startswith("fc_norm")} == norms
    # an engine-written folder has no draftsmith block: the switches come from the config keys
    file = tmp_path / "e3" / "config.json"
    file.write_text(
        json.dumps({k: v for k, v in json.loads(file.read_text()).items() if k != "draftsmith"})
    )
    back = interop.import_draft(tmp_path / "e3", llama6)
    assert (back.config.fc_norm, back.config.norm_output) == (fc_norm, norm_output)
    _same_tensors(head, back)
    _same_eagle_outputs(head, back)


# Source: vllm-project/speculators c05b95b src/speculators/models/eagle3/config.py
# (Eagle3SpeculatorConfig: transformer_layer_config, draft_vocab_size, norm_before_residual,
# norm_before_fc, fc_norm, norm_output, target_hidden_size, eagle_aux_hidden_state_layer_ids,
# embed_requires_grad), src/speculators/config.py (speculators_config) and models/eagle3/core.py
# (fc, fc_norm.{i}, layers.0.*, norm, lm_head; embed_tokens, d2t, t2d optional on load); vLLM's
# speculators reader (algos.py update_eagle3) defaults a missing norm_before_residual to true.
@pytest.mark.parametrize("fc_norm", [False, True])
def test_eagle3_speculators_schema_and_round_trip(llama6, tmp_path, fc_norm):
    head = _eagle3(llama6, draft_vocab_size=50, fc_norm=fc_norm, norm_output=True, ttt_steps=3)
    interop.export_draft(head, llama6, "speculators", tmp_path / "s")
    config, provenance, shapes, _ = _files(tmp_path / "s")
    layer = {k: v for k, v in LLAMA_KEYS.items() if k != "torch_dtype"}
    assert config == {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": 50,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": fc_norm,
        "norm_output": True,
        "target_hidden_size": 64,
        "eagle_aux_hidden_state_layer_ids": [2, 3, 3],
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": 3,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny-llama6", "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": "float32",
    }
    assert provenance["format"] == "speculators"
    eagle3 = interop.export_draft(head, llama6, "eagle3", tmp_path / "e3")
    assert shapes == _files(tmp_path / "e3")[2]  # the same tensors as the engines' layout
    assert ("fc_norm.0.weight" in shapes) == fc_norm and eagle3["norm_output"] is True
    # a folder speculators wrote: no draftsmith block, its (frozen) copy of the embeddings
    file = tmp_path / "s" / "config.json"
    file.write_text(
        json.dumps({k: v for k, v in json.loads(file.read_text()).items() if k != "draftsmith"})
    )
    tensors = load_file(str(tmp_path / "s" / "model.safetensors"))
    tensors["embed_tokens.weight"] = llama6.embed_tokens.weight.detach().clone()
    save_file(tensors, str(tmp_path / "s" / "model.safetensors"))
    assert interop.detect_format(tmp_path / "s") == "speculators"
    back = interop.import_draft(tmp_path / "s", llama6)
    assert type(back) is Eagle3Head
    assert (back.config.fc_norm, back.config.norm_output) == (fc_norm, True)
    _same_tensors(head, back)
    _same_eagle_outputs(head, back)


def test_eagle3_import_refuses_norm_variants_it_does_not_build(llama6, tmp_path):
    interop.export_draft(_eagle3(llama6), llama6, "eagle3", tmp_path / "e3")
    file = tmp_path / "e3" / "config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | {"norm_before_residual": True}))
    with pytest.raises(HeadMismatchError, match="norm_before_residual"):
        interop.import_draft(tmp_path / "e3", llama6)


def test_eagle_round_trip(tiny_target, tmp_path):
    head = _eagle(tiny_target)
    back = _round_trip(head, tiny_target, "eagle", tmp_path)
    assert back.config == head.config
    _same_eagle_outputs(head, back)


@pytest.mark.parametrize(("draft_vocab_size", "share"), [(40, False), (None, True), (40, True)])
def test_medusa_round_trip(tiny_llama, tmp_path, draft_vocab_size, share):
    head = _medusa(tiny_llama, num_layers=2, draft_vocab_size=draft_vocab_size, share_lm_head=share)
    back = _round_trip(head, tiny_llama, "medusa", tmp_path)
    assert back.config == head.config
    _same_medusa_outputs(head, back)


@pytest.mark.parametrize("share", [False, True])
def test_medusa_fd_round_trip(tiny_llama, tmp_path, share):
    head = _medusa(tiny_llama, num_heads=3, share_lm_head=share)
    back = _round_trip(head, tiny_llama, "medusa_fd", tmp_path)
    assert back.config == head.config
    _same_medusa_outputs(head, back)


def test_native_round_trip(tiny_llama, tmp_path):
    head = _eagle3(tiny_llama)
    config = interop.export_draft(head, tiny_llama, "native", tmp_path / "n")
    assert config["method"] == "eagle3" and interop.detect_format(tmp_path / "n") == "native"
    _same_tensors(head, interop.import_draft(tmp_path / "n", tiny_llama))


def test_from_pretrained_loads_an_exported_eagle3_folder(tiny_llama, tmp_path):
    head = _eagle3(tiny_llama, draft_vocab_size=50)
    interop.export_draft(head, tiny_llama, "eagle3", tmp_path / "e3")
    back = heads.from_pretrained(tmp_path / "e3", tiny_llama)
    assert isinstance(back, Eagle3Head)
    _same_tensors(head, back)


def test_imports_a_specforge_checkpoint(tiny_llama, tmp_path):
    """midlayer.* names, a model. prefix, pytorch_model.bin, a plain LlamaForCausalLM config and
    a copy of the target's embedding, as SafeAILab / SpecForge EAGLE-3 checkpoints have."""
    head = _eagle3(tiny_llama, draft_vocab_size=50, aux_layers=[0, 1, 1])
    config = interop.export_draft(head, tiny_llama, "eagle3", tmp_path / "e3")
    tensors = {
        ("model." if k == "fc.weight" else "") + k.replace("layers.0.", "midlayer."): v
        for k, v in load_file(str(tmp_path / "e3" / "model.safetensors")).items()
    }
    tensors["embed_tokens.weight"] = tiny_llama.embed_tokens.weight.detach().clone()
    (tmp_path / "sf").mkdir()
    torch.save(tensors, tmp_path / "sf" / "pytorch_model.bin")
    config = {k: v for k, v in config.items() if k != "draftsmith"}
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "sf" / "config.json").write_text(json.dumps(config))
    assert interop.detect_format(tmp_path / "sf") == "eagle3"
    back = interop.import_draft(tmp_path / "sf", tiny_llama)
    assert back.config.aux_layers == [0, 1, 1]
    _same_tensors(head, back)


def test_imports_vllm_medusa_with_unsorted_token_map_and_full_lm_head(tiny_llama, tmp_path):
    """vLLM keeps a token_map in any order and slices a full-vocabulary lm_head by it."""
    head = _medusa(tiny_llama, num_heads=2, draft_vocab_size=40)
    interop.export_draft(head, tiny_llama, "medusa", tmp_path / "m")
    file = str(tmp_path / "m" / "model.safetensors")
    tensors = load_file(file)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    token_map = tensors["token_map"]
    tensors["token_map"] = token_map[perm]
    tensors["lm_heads.1.weight"] = tensors["lm_heads.1.weight"][perm].contiguous()
    full = torch.randn(V, H)
    full[token_map] = tensors["lm_heads.0.weight"]
    tensors["lm_heads.0.weight"] = full
    save_file(tensors, file)
    back = interop.import_draft(tmp_path / "m", tiny_llama)
    _same_tensors(head, back)
    _same_medusa_outputs(head, back)


def test_aux_layer_ids_for_both_engines(llama6, tmp_path):
    interop.export_draft(_eagle3(llama6), llama6, "eagle3", tmp_path / "default")
    config = json.loads((tmp_path / "default" / "config.json").read_text())
    assert "eagle_aux_hidden_state_layer_ids" not in config and "eagle_config" not in config

    head = _eagle3(llama6, aux_layers=[1, 3, 5])
    config = interop.export_draft(head, llama6, "eagle3", tmp_path / "custom")
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # vLLM: hidden_states index
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}  # SGLang
    assert interop.import_draft(tmp_path / "custom", llama6).config.aux_layers == [1, 3, 5]
    del config["eagle_aux_hidden_state_layer_ids"]  # SGLang's field alone still reads back
    (tmp_path / "custom" / "config.json").write_text(json.dumps(config))
    assert interop.import_draft(tmp_path / "custom", llama6).config.aux_layers == [1, 3, 5]


# ---- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "fmt", "fits"),
    [
        (_medusa, "eagle3", "native, medusa, medusa_fd"),
        (_eagle3, "medusa", "native, eagle3, speculators"),
        (_eagle, "eagle3", "native, eagle"),
    ],
)
def test_refuses_a_format_that_does_not_fit(tiny_llama, tmp_path, make, fmt, fits):
    with pytest.raises(ValueError, match=fits):
        interop.export_draft(make(tiny_llama), tiny_llama, fmt, tmp_path / "x")
    with pytest.raises(ValueError, match="unknown format"):
        interop.export_draft(make(tiny_llama), tiny_llama, "gguf", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_refuses_medusa_fd_with_a_reduced_vocab(tiny_llama, tmp_path):
    head = _medusa(tiny_llama, draft_vocab_size=40)
    with pytest.raises(ValueError, match=r"--format medusa.*draft_vocab_size=null"):
        interop.export_draft(head, tiny_llama, "medusa_fd", tmp_path / "fd")


def test_refuses_eagle_with_input_norm(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="input_norm"):
        interop.export_draft(_eagle(tiny_llama, input_norm=True), tiny_llama, "eagle", tmp_path)


def test_refuses_medusa2_outside_native(tokenizer, tmp_path):
    from heads.medusa2 import Medusa2Config, Medusa2Head

    target = Target.from_model(make_llama(), tokenizer, name_or_path="tiny-llama")
    head = Medusa2Head.for_target(Medusa2Config(num_heads=2), target)
    for fmt in ("eagle3", "eagle", "medusa", "medusa_fd"):
        with pytest.raises(ValueError, match="merge_into_target"):
            interop.export_draft(head, target, fmt, tmp_path / fmt)
    assert interop.export_draft(head, target, "native", tmp_path / "n")["method"] == "medusa2"


@pytest.mark.parametrize("fmt", ["eagle3", "eagle", "medusa", "medusa_fd"])
def test_refuses_a_draft_for_another_hidden_size(tiny_llama, tmp_path, fmt):
    make = {"eagle3": _eagle3, "eagle": _eagle}.get(fmt, _medusa)
    interop.export_draft(make(tiny_llama), tiny_llama, fmt, tmp_path / fmt)
    other = Target.from_model(make_llama(hidden=32), make_tokenizer(), name_or_path="small")
    with pytest.raises(HeadMismatchError, match="hidden_size=64.*another model"):
        interop.import_draft(tmp_path / fmt, other)


def test_refuses_a_missing_tensor(tiny_llama, tmp_path):
    interop.export_draft(_eagle3(tiny_llama), tiny_llama, "eagle3", tmp_path / "e3")
    file = str(tmp_path / "e3" / "model.safetensors")
    tensors = load_file(file)
    del tensors["layers.0.mlp.up_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(HeadMismatchError, match="lacks 1 tensors.*up_proj"):
        interop.import_draft(tmp_path / "e3", tiny_llama)


def test_refuses_an_embedding_that_is_not_the_targets(tiny_llama, tmp_path):
    head = _eagle(tiny_llama)
    interop.export_draft(head, tiny_llama, "eagle", tmp_path / "e1")
    file = str(tmp_path / "e1" / "model.safetensors")
    tensors = load_file(file)
    tensors["embed_tokens.weight"] = tiny_llama.embed_tokens.weight.detach().clone()
    save_file(tensors, file)
    _same_tensors(head, interop.import_draft(tmp_path / "e1", tiny_llama))  # a copy is fine
    tensors["embed_tokens.weight"] = torch.randn(V, H)
    save_file(tensors, file)
    with pytest.raises(HeadMismatchError, match="embed_tokens.weight differs"):
        interop.import_draft(tmp_path / "e1", tiny_llama)


def test_refuses_an_unknown_format(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    save_file({"encoder.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unknown draft format"):
        interop.detect_format(tmp_path)
