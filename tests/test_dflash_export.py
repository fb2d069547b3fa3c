"""DFlash exports (heads/interop/dflash.py): z-lab's layout (`dflash`), speculators'
(`speculators`), on tiny random 4-layer targets (DeepSpec's checkpoints, read as DSpark heads:
tests/test_deepspec_import.py).

The schema tests pin each layout as the reference code reads and writes it; the source of each
key and tensor is named beside the test (snapshots: z-lab/dflash 44947fb, vllm-project/speculators
c05b95b, sgl-project/SpecForge a6b6b02, llama.cpp build 11434). The round trips prove that an
export loads back into the same head: identical tensors, identical block drafts, and the same
greedy output and accept lengths through eval/publish/export.py's check.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import diverse, make_llama, make_qwen2, make_tokenizer
from safetensors.torch import load_file, save_file

import heads
from heads import interop
from heads.base import HeadMismatchError
from heads.dflash import DFlashConfig, DFlashHead
from heads.folder import HeadFolderError
from heads.interop.dflash import MASK_EMBEDDING
from heads.target import Target

V, H = 256, 64
F32, I64, BOOL = torch.float32, torch.int64, torch.bool
IDS = [0, 2]  # z-lab target_layer_ids (decoder-layer outputs, HF hidden_states[id + 1])
MASK = 5
ROOT = Path(__file__).resolve().parents[1]

# Qwen3 layer keys of a 2-layer draft on conftest's tiny Llama (hidden 64, 4 heads / 2 kv).
# Read by z-lab/dflash dflash/model.py (DFlashDraftModel.__init__, Qwen3DFlashAttention) and
# model_mlx.py (load_draft); the full key set follows SpecForge configs/qwen3-8b-dflash.json.
QWEN3_KEYS = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "hidden_act": "silu",
    "vocab_size": 256,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "layer_types": ["full_attention", "full_attention"],
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 2,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "use_cache": True,
    "dtype": "float32",
    "bos_token_id": 2,
    "eos_token_id": 3,
}


def _body(layers: int = 2) -> dict:
    """The draft body both layouts share (z-lab DFlashDraftModel's module tree; speculators'
    Qwen3DFlashDecoderLayer in models/dflash/model_definitions.py has the same names)."""
    out = {"fc.weight": (F32, (H, len(IDS) * H)), "hidden_norm.weight": (F32, (H,))}
    for i in range(layers):
        p = f"layers.{i}."
        out |= {
            p + "input_layernorm.weight": (F32, (H,)),
            p + "self_attn.q_proj.weight": (F32, (64, H)),
            p + "self_attn.k_proj.weight": (F32, (32, H)),
            p + "self_attn.v_proj.weight": (F32, (32, H)),
            p + "self_attn.o_proj.weight": (F32, (H, 64)),
            p + "self_attn.q_norm.weight": (F32, (16,)),
            p + "self_attn.k_norm.weight": (F32, (16,)),
            p + "post_attention_layernorm.weight": (F32, (H,)),
            p + "mlp.gate_proj.weight": (F32, (128, H)),
            p + "mlp.up_proj.weight": (F32, (128, H)),
            p + "mlp.down_proj.weight": (F32, (H, 128)),
        }
    return out | {"norm.weight": (F32, (H,))}


@pytest.fixture(scope="module")
def target():
    return Target.from_model(diverse(make_llama(layers=4)), make_tokenizer(), name_or_path="tiny")


def _head(target, seed=0, **kw):
    """A DFlash head with random weights everywhere (a learned MASK vector off its row)."""
    kw = {"block_size": 5, "target_layer_ids": IDS, "mask_token_id": MASK, **kw}
    counts = torch.arange(target.vocab_size).float()
    head = DFlashHead.for_target(DFlashConfig(**kw), target, token_counts=counts)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return head.eval()


def _files(folder):
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    shapes = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    return config, config.pop("draftsmith"), shapes, tensors


def _same_tensors(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


def _same_drafts(a, b):
    """Both heads draft the same logits and tokens from the same committed context."""
    g = torch.Generator().manual_seed(3)
    aux = torch.randn(2, 9, len(IDS) * H, generator=g)
    pos = torch.arange(9).expand(2, 9)
    anchor, where = torch.tensor([7, MASK]), torch.tensor([9, 9])  # an anchor that is MASK too
    out = []
    for head in (a, b):
        cache = head.new_cache()
        head.extend_cache(cache, head.context({"aux": aux}), pos)
        out.append(head.draft_block(anchor, where, cache))
    assert torch.equal(out[0], out[1])
    assert torch.equal(a.draft_to_target(out[0].argmax(-1)), b.draft_to_target(out[1].argmax(-1)))


def _round_trip(head, target, fmt, folder):
    interop.export_draft(head, target, fmt, folder)
    assert interop.detect_format(folder) == fmt
    back = heads.from_pretrained(folder, target)  # the one door: foreign folders go to interop
    assert type(back) is DFlashHead and back.config == head.config
    _same_tensors(head, back)
    _same_drafts(head, back)
    return back


# ---- schemas ---------------------------------------------------------------------------------


# Sources: z-lab/dflash dflash/model.py (architectures, block_size at the top level,
# num_target_layers, dflash_config.{mask_token_id, target_layer_ids}; tensors of
# DFlashDraftModel, no embed_tokens / lm_head: dflash_generate uses the target's);
# SpecForge configs/qwen3-8b-dflash.json and specforge/algorithms/dflash/providers.py (auto_map);
# llama.cpp conversion/qwen.py DFlashModel (dflash_config.block_size, read before the top level;
# generate_extra_tensors reads mask_embedding.pt = {"mask_token_id", "embedding" [H]}).
def test_zlab_schema(target, tmp_path):
    head = _head(target)
    returned = interop.export_draft(head, target, "dflash", tmp_path / "z")
    config, provenance, shapes, _ = _files(tmp_path / "z")
    assert config == {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 5,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": IDS, "block_size": 5},
        "num_target_layers": 4,
        **QWEN3_KEYS,
    }
    assert returned == {**config, "draftsmith": provenance}
    assert provenance["format"] == "dflash" and provenance["base_model"] == "tiny"
    assert provenance["targets"] == interop.ENGINE_VERSIONS["dflash"]
    assert shapes == _body()
    assert sorted(p.name for p in (tmp_path / "z").iterdir()) == sorted(
        ["config.json", "model.safetensors", MASK_EMBEDDING]
    )
    mask = torch.load(tmp_path / "z" / MASK_EMBEDDING, weights_only=True)
    assert set(mask) == {"mask_token_id", "embedding"} and mask["mask_token_id"] == MASK
    assert mask["embedding"].shape == (H,) and torch.equal(mask["embedding"], head.mask_embedding)


def test_zlab_without_a_learned_mask_writes_no_mask_file(target, tmp_path):
    interop.export_draft(_head(target, learn_mask=False), target, "dflash", tmp_path / "z")
    assert sorted(p.name for p in (tmp_path / "z").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


# Sources: vllm-project/speculators src/speculators/config.py (SpeculatorModelConfig:
# speculators_model_type, speculators_version, speculators_config {algorithm, proposal_methods,
# default_proposal_method, verifier {name_or_path, architectures}}), proposals/greedy.py
# (GreedyTokenProposalConfig fields), models/dflash/config.py (DFlashSpeculatorConfig:
# architectures, transformer_layer_config, draft_vocab_size, block_size, target_hidden_size,
# aux_hidden_state_layer_ids, mask_token_id, sliding_window_non_causal, sample_from_anchor),
# models/dflash/core.py (speculative_tokens = block_size - 1 without sample_from_anchor),
# convert/dflash/converter.py (aux ids = z-lab ids + 1; the Qwen3 keys without the z-lab-only
# ones), model.py DraftVocabMixin._init_vocab (embed_tokens [V, H] and lm_head [D, H] saved;
# d2t [D] / t2d [V] only when draft_vocab_size != vocab_size).
def test_speculators_schema(target, tmp_path):
    head = _head(target)
    interop.export_draft(head, target, "speculators", tmp_path / "s")
    config, provenance, shapes, tensors = _files(tmp_path / "s")
    assert config == {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": "0.9.0",
        "transformer_layer_config": QWEN3_KEYS,
        "draft_vocab_size": V,
        "block_size": 5,
        "target_hidden_size": H,
        "aux_hidden_state_layer_ids": [i + 1 for i in IDS],
        "mask_token_id": MASK,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": 4,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]},
        },
        "dtype": "float32",
    }
    assert provenance["targets"] == interop.ENGINE_VERSIONS["speculators"]
    assert shapes == {
        **_body(),
        "embed_tokens.weight": (F32, (V, H)),
        "lm_head.weight": (F32, (V, H)),
    }
    # the learned MASK vector sits in the mask token's row; every other row is the target's
    embed = target.embed_tokens.weight.detach()
    assert torch.equal(tensors["embed_tokens.weight"][MASK], head.mask_embedding.detach())
    others = torch.arange(V) != MASK
    assert torch.equal(tensors["embed_tokens.weight"][others], embed[others])
    assert torch.equal(tensors["lm_head.weight"], target.lm_head.weight.detach())


def test_speculators_reduced_vocabulary_writes_its_maps(target, tmp_path):
    head = _head(target, draft_vocab_size=100)
    interop.export_draft(head, target, "speculators", tmp_path / "s")
    config, _, shapes, tensors = _files(tmp_path / "s")
    assert config["draft_vocab_size"] == 100
    assert shapes["lm_head.weight"] == (F32, (100, H))
    assert shapes["d2t"] == (I64, (100,)) and shapes["t2d"] == (BOOL, (V,))
    ids = torch.arange(100) + tensors["d2t"]  # target id = draft id + d2t[draft id]
    assert torch.equal(ids, head.draft_to_target(torch.arange(100)))
    assert torch.equal(tensors["t2d"].nonzero()[:, 0], ids)


# ---- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["dflash", "speculators"])
@pytest.mark.parametrize("learn_mask", [True, False])
def test_round_trip_gives_the_same_head(fmt, learn_mask, target, tmp_path):
    _round_trip(_head(target, learn_mask=learn_mask), target, fmt, tmp_path / fmt)


def test_speculators_round_trip_with_a_reduced_vocabulary(target, tmp_path):
    back = _round_trip(_head(target, draft_vocab_size=100), target, "speculators", tmp_path / "s")
    assert back.draft_vocab_size == 100


def test_qwen2_target_round_trip(tmp_path):
    qwen = Target.from_model(diverse(make_qwen2(layers=4)), make_tokenizer(), name_or_path="q")
    for fmt in ("dflash", "speculators"):
        _round_trip(_head(qwen), qwen, fmt, tmp_path / fmt)


@pytest.mark.parametrize("fmt", ["dflash", "speculators"])
def test_a_reference_folder_without_our_records_loads(fmt, target, tmp_path):
    """A folder z-lab / speculators wrote carries no `draftsmith` block: the head comes from the
    layout alone (config fields of training, such as num_anchors, take their defaults)."""
    head = _head(target, intermediate_size=96)
    folder = tmp_path / fmt
    interop.export_draft(head, target, fmt, folder)
    doc = json.loads((folder / "config.json").read_text())
    del doc["draftsmith"]
    (folder / "config.json").write_text(json.dumps(doc))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({f"model.{k}": v for k, v in tensors.items()}, str(folder / "model.safetensors"))
    back = interop.import_draft(folder, target)
    fields = ("num_layers", "block_size", "target_layer_ids", "mask_token_id", "learn_mask")
    assert all(getattr(back.config, f) == getattr(head.config, f) for f in fields)
    assert back.config.intermediate_size == 96
    _same_tensors(head, back)
    _same_drafts(head, back)


def test_zlab_ids_default_to_the_reference_formula(target, tmp_path):
    head = _head(target, learn_mask=False, target_layer_ids=[1, 1])  # what 4 layers give
    folder = tmp_path / "z"
    interop.export_draft(head, target, "dflash", folder)
    doc = json.loads((folder / "config.json").read_text())
    del doc["draftsmith"], doc["dflash_config"]["target_layer_ids"]
    (folder / "config.json").write_text(json.dumps(doc))
    assert interop.import_draft(folder, target).config.target_layer_ids == [1, 1]


def _tiny_folder_target(tmp_path, layers=4):
    """A tiny Llama saved as a Hugging Face folder, so that a run dir can name it."""
    folder = tmp_path / "target"
    diverse(make_llama(layers=layers)).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def _run_dir(tmp_path, head, target_dir):
    run = tmp_path / "run"
    head.save_pretrained(run / "best_head")
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"name_or_path": str(target_dir)}}))
    return run


@pytest.mark.parametrize("fmt", ["dflash", "speculators"])
def test_the_command_line_exports_a_proved_folder(fmt, tmp_path, capsys):
    from train.rundir import load_target_config

    target_dir = _tiny_folder_target(tmp_path)
    target = load_target_config({"name_or_path": str(target_dir)})
    run = _run_dir(tmp_path, _head(target), target_dir)
    spec = importlib.util.spec_from_file_location("export_cli", ROOT / "scripts" / "export.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = tmp_path / "out"
    argv = [str(run), "--format", fmt, "--out", str(out), "--check-prompts", "2"]
    assert cli.main(argv + ["--check-tokens", "12"]) == 0, capsys.readouterr().err
    assert "round trip on 2 prompts" in capsys.readouterr().out
    check = json.loads((out / "export.json").read_text())["check"]
    assert check["tau_head"] == check["tau_export"] and check["tree"] == "tree16"
    card = (out / "README.md").read_text()
    assert "learned its MASK vector" in card
    if fmt == "dflash":
        assert '"method": "dflash"' in card and "--speculative-algorithm DFLASH" in card
        assert "--spec-type draft-dflash --spec-draft-n-max 4" in card
        assert "z-lab's, vLLM's and SGLang's DFlash runtimes ignore the file" in card
    else:
        assert f"vllm serve {out.name}" not in card and "vllm serve DRAFT_DIR" in card
    assert type(heads.from_pretrained(out, target)) is DFlashHead


# ---- refusals --------------------------------------------------------------------------------


def test_a_reduced_vocabulary_is_refused_in_the_zlab_layout_only(target, tmp_path):
    from heads.interop.gguf import gguf_source_format

    head = _head(target, draft_vocab_size=100)
    with pytest.raises(ValueError, match=r"--format speculators.*draft_vocab_size=null"):
        interop.export_draft(head, target, "dflash", tmp_path / "z")
    assert not (tmp_path / "z").exists()
    # llama.cpp takes it through its DSpark converter, which reads d2t (tests/test_llama_cpp.py)
    assert gguf_source_format(head) == "speculators"
    assert gguf_source_format(_head(target)) == "dflash"


def test_imports_onto_another_target_are_refused(target, tmp_path):
    interop.export_draft(_head(target), target, "dflash", tmp_path / "z")
    deeper = Target.from_model(make_llama(layers=6), make_tokenizer(), name_or_path="deeper")
    with pytest.raises(HeadMismatchError, match="4-layer target"):
        interop.import_draft(tmp_path / "z", deeper)
    wider = Target.from_model(make_llama(layers=4, hidden=32), make_tokenizer(), name_or_path="w")
    with pytest.raises(HeadMismatchError, match="hidden_size"):
        interop.import_draft(tmp_path / "z", wider)
    same_size = Target.from_model(make_llama(seed=9, layers=4), make_tokenizer(), name_or_path="o")
    with pytest.raises(HeadMismatchError):  # another model of the same sizes: the fingerprint
        interop.import_draft(tmp_path / "z", same_size)
    assert interop.import_draft(tmp_path / "z", same_size, allow_other_target=True)


def test_a_mask_file_of_another_draft_is_refused(target, tmp_path):
    folder = tmp_path / "z"
    interop.export_draft(_head(target), target, "dflash", folder)
    torch.save({"mask_token_id": MASK + 1, "embedding": torch.zeros(H)}, folder / MASK_EMBEDDING)
    with pytest.raises(HeadFolderError, match="differs from dflash_config"):
        interop.import_draft(folder, target)
    torch.save({"mask_token_id": MASK, "embedding": torch.zeros(H + 1)}, folder / MASK_EMBEDDING)
    with pytest.raises(HeadFolderError, match="target's width"):
        interop.import_draft(folder, target)


def test_anchor_sampled_speculators_drafts_are_refused(target, tmp_path):
    folder = tmp_path / "s"
    interop.export_draft(_head(target), target, "speculators", folder)
    doc = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(doc | {"sample_from_anchor": True}))
    with pytest.raises(HeadMismatchError, match="sample_from_anchor=true"):
        interop.import_draft(folder, target)
    doc["transformer_layer_config"]["layer_types"] = ["sliding_attention", "full_attention"]
    (folder / "config.json").write_text(json.dumps(doc))
    with pytest.raises(HeadMismatchError, match="sliding"):
        interop.import_draft(folder, target)


def test_other_dspark_layouts_are_refused(tmp_path):
    folder = tmp_path / "dspark"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["DSparkDraftModel"]}))
    with pytest.raises(HeadMismatchError, match="does not read"):
        interop.detect_format(folder)


def test_only_the_formats_a_head_declares_are_written(target, tmp_path):
    assert interop.formats_for(_head(target)) == ("native", "dflash", "speculators")
    with pytest.raises(ValueError, match="cannot be exported as 'eagle3'"):
        interop.export_draft(_head(target), target, "eagle3", tmp_path / "e")
    eagle3 = heads.build_head(heads.Eagle3Config(draft_vocab_size=None), target)
    with pytest.raises(ValueError, match="cannot be exported as 'dflash'"):
        interop.export_draft(eagle3, target, "dflash", tmp_path / "d")
    assert dataclasses.is_dataclass(DFlashConfig)


# ---- DSpark in speculators' layout ----------------------------------------------------------


@pytest.fixture
def dspark_exportable():
    """DSparkHead, which lists the speculators layout among its export formats."""
    from heads.dspark import DSparkHead

    assert "speculators" in DSparkHead.export_formats
    return DSparkHead


def _dspark(target, **kw):
    from heads.dspark import DSparkConfig, DSparkHead

    kw = {"block_size": 5, "markov_rank": 8, "target_layer_ids": IDS, "mask_token_id": MASK, **kw}
    counts = torch.arange(target.vocab_size).float()
    head = DSparkHead.for_target(DSparkConfig(**kw), target, token_counts=counts)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return head.eval()


# Sources: vllm-project/speculators models/dspark/config.py (DSparkSpeculatorConfig:
# architectures ["DSparkSpeculator"], sample_from_anchor true, markov_rank, markov_head_type,
# enable_confidence_head, confidence_head_with_markov), models/dflash/core.py
# (_build_base_config_kwargs: speculative_tokens = block_size when sampling from the anchor),
# models/dspark/model_definitions.py (markov_head.markov_w1 [V, r], markov_head.markov_w2 [D, r],
# confidence_head.proj [1, H + r] + bias); llama.cpp conversion/qwen.py DSparkModel reads it.
def test_dspark_speculators_schema(dspark_exportable, target, tmp_path):
    head = _dspark(target)
    interop.export_draft(head, target, "speculators", tmp_path / "s")
    config, _, shapes, _ = _files(tmp_path / "s")
    assert config["architectures"] == ["DSparkSpeculator"]
    assert config["speculators_model_type"] == config["speculators_config"]["algorithm"] == "dspark"
    assert config["sample_from_anchor"] is True
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert {k: config[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                   "confidence_head_with_markov")} == {
        "markov_rank": 8, "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True}  # fmt: skip
    assert shapes == {
        **_body(),
        "embed_tokens.weight": (F32, (V, H)),
        "lm_head.weight": (F32, (V, H)),
        "markov_head.markov_w1.weight": (F32, (V, 8)),
        "markov_head.markov_w2.weight": (F32, (V, 8)),
        "confidence_head.proj.weight": (F32, (1, H + 8)),
        "confidence_head.proj.bias": (F32, (1,)),
    }


@pytest.mark.parametrize("kw", [{}, {"learn_mask": False, "draft_vocab_size": 100},
                                {"enable_confidence_head": False}])  # fmt: skip
def test_dspark_speculators_round_trip(kw, dspark_exportable, target, tmp_path):
    head = _dspark(target, **kw)
    interop.export_draft(head, target, "speculators", tmp_path / "s")
    back = heads.from_pretrained(tmp_path / "s", target)
    assert type(back) is dspark_exportable and back.config == head.config
    _same_tensors(head, back)


def test_dspark_without_anchor_sampling_is_refused(dspark_exportable, target, tmp_path):
    interop.export_draft(_dspark(target), target, "speculators", tmp_path / "s")
    doc = json.loads((tmp_path / "s" / "config.json").read_text())
    (tmp_path / "s" / "config.json").write_text(json.dumps(doc | {"sample_from_anchor": False}))
    with pytest.raises(HeadMismatchError, match="sample_from_anchor=false"):
        interop.import_draft(tmp_path / "s", target)


def test_gguf_sources_and_spec_types(dspark_exportable, target):
    from heads.interop.gguf import gguf_source_format, spec_type_for

    assert gguf_source_format(_head(target)) == "dflash"
    assert spec_type_for(_head(target)) == "draft-dflash"
    assert gguf_source_format(_dspark(target)) == "speculators"
    assert spec_type_for(_dspark(target)) == "draft-dspark"
