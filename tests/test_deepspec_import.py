"""DeepSpec checkpoints (deepseek-ai/DeepSpec `Qwen3DSparkModel`) imported as DSparkHeads
(heads/interop/deepspec.py), on tiny random 4-layer targets.

A DeepSpec folder is written from a random DSparkHead with the keys and tensor names DeepSpec's
own code writes (the schema pinned below, sources beside it; snapshot deepseek-ai/DeepSpec
afdfa7c). Importing it must give the same head: equal tensors, the same greedy block chains, and
the same generated tokens and accept lengths. Its DFlash checkpoints (markov_rank 0) come back as
a DSparkHead without Markov and confidence heads; the layouts DSparkHead cannot represent, and
drafts for another target, are refused.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import diverse, make_llama, make_qwen2, make_tokenizer
from safetensors.torch import save_file

import heads
from eval.engine.block_proposer import BlockProposer
from eval.engine.generator import SpeculativeGenerator
from eval.engine.tree import chain_tree
from eval.engine.verify import GreedyVerifier
from heads import interop
from heads.base import HeadMismatchError
from heads.dspark import DSparkConfig, DSparkHead
from heads.target import Target

H, IDS, MASK, BLOCK, RANK = 64, [0, 2], 5, 5, 8
PROMPT = torch.tensor([[2, 40, 17, 99, 5, 63, 120, 8]])


# The DeepSpec keys on top of the deep-copied target config, from
# deepspec/modeling/dspark/qwen3/config.py `build_draft_config`: confidence_head_with_markov is
# written only with the confidence head, markov_head_type only when markov_rank > 0.
def deepspec_config(target, head) -> dict:
    c = head.config
    doc = target.model.config.to_dict()  # copy.deepcopy(target_config)
    doc |= {
        "architectures": ["Qwen3DSparkModel"],
        "num_target_layers": target.num_layers,
        "num_hidden_layers": c.num_layers,
        "block_size": c.block_size,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * c.num_layers,
        "mask_token_id": c.mask_token_id,
        "target_layer_ids": list(c.target_layer_ids),
        "num_anchors": c.num_anchors,
        "enable_confidence_head": c.enable_confidence_head,
        "markov_rank": c.markov_rank,
    }
    if c.enable_confidence_head:
        doc["confidence_head_with_markov"] = True
    if c.markov_rank > 0:
        doc["markov_head_type"] = "vanilla"
    return doc


# The saved state dict of Qwen3DSparkModel (deepspec/trainer/ckpt_manager.py
# `_save_model_checkpoint`; module tree in deepspec/modeling/dspark/qwen3/modeling.py, the heads
# in deepspec/modeling/dspark/markov_head.py `VanillaMarkov` and common.py `AcceptRatePredictor`):
# name -> shape, for V target tokens, n fused layers, MLP width I, q / kv widths and r.
def deepspec_schema(V, layers, n, inner, q, kv, head_dim, r, confidence) -> dict:
    shapes = {
        "embed_tokens.weight": (V, H),  # frozen copy of the target's
        "lm_head.weight": (V, H),  # frozen copy of the target's
        "fc.weight": (H, n * H),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
    }
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q, H),
            p + "self_attn.k_proj.weight": (kv, H),
            p + "self_attn.v_proj.weight": (kv, H),
            p + "self_attn.o_proj.weight": (H, q),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (inner, H),
            p + "mlp.up_proj.weight": (inner, H),
            p + "mlp.down_proj.weight": (H, inner),
        }
    if r > 0:
        shapes["markov_head.markov_w1.weight"] = (V, r)  # Embedding(V, r)
        shapes["markov_head.markov_w2.weight"] = (V, r)  # Linear(r, V, bias=False)
    if confidence:
        shapes["confidence_head.proj.weight"] = (1, H + r)  # Linear(H + r, 1) on [h; w1(prev)]
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def deepspec_tensors(target, head) -> dict:
    """The head's weights under DeepSpec's names: its own embed_tokens (the MASK row being the
    mask vector DeepSpec would embed) and lm_head, the body and heads as they are."""
    embed = target.embed_tokens.weight.detach().clone()
    if head.mask_embedding is not None:
        embed[head.config.mask_token_id] = head.mask_embedding.detach()
    skip = ("d2t", "t2d", "mask_embedding")
    out = {k: v.detach().clone() for k, v in head.state_dict().items() if k not in skip}
    out |= {"embed_tokens.weight": embed, "lm_head.weight": target.lm_head.weight.detach().clone()}
    return out


def write_deepspec(folder, target, head, doc=None, tensors=None):
    folder.mkdir(parents=True, exist_ok=True)
    doc = deepspec_config(target, head) if doc is None else doc
    tensors = deepspec_tensors(target, head) if tensors is None else tensors
    (folder / "config.json").write_text(json.dumps(doc))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def _target(kind="llama", **kw):
    make = make_llama if kind == "llama" else make_qwen2
    return Target.from_model(diverse(make(layers=4, **kw)), make_tokenizer(), name_or_path=kind)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    return _target(request.param)


def _dspark(target, seed=0, **kw):
    """A DSparkHead with random weights everywhere (a learned MASK vector off its row)."""
    kw = {"block_size": BLOCK, "markov_rank": RANK, "target_layer_ids": IDS,
          "mask_token_id": MASK, "num_anchors": 16, **kw}  # fmt: skip
    head = DSparkHead.for_target(DSparkConfig(**kw), target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return head.eval()


def _dflash(target, **kw):
    """DeepSpec's DFlash: anchor-sampled, no Markov head, no confidence head, CE only."""
    return _dspark(target, markov_rank=0, enable_confidence_head=False, ce_weight=1.0,
                   l1_weight=0.0, **kw)  # fmt: skip


def _same_tensors(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


def _same_chains(a, b, target):
    """Both heads draft the same block logits and greedy chains from the same context."""
    feats = target.features(PROMPT, torch.ones_like(PROMPT), a.feature_layers())
    pos = torch.arange(PROMPT.shape[1])[None]
    where = torch.tensor([PROMPT.shape[1]])
    for root in (torch.tensor([7]), torch.tensor([MASK])):  # an anchor that is the mask token
        blocks, chains = [], []
        for head in (a, b):
            cache = head.new_cache()
            head.extend_cache(cache, head.context(feats), pos)
            blocks.append(head.draft_block(root, where, cache))
            chains.append(head.draft_chain(root, where, cache, BLOCK)[0])
        assert torch.equal(blocks[0], blocks[1])
        assert chains[0].numel() == BLOCK and torch.equal(chains[0], chains[1])


def _same_generation(a, b, target):
    runs = []
    for head in (a, b):
        gen = SpeculativeGenerator(target.model, BlockProposer(head, chain_tree(BLOCK)),
                                   GreedyVerifier())  # fmt: skip
        runs.append(gen.generate(PROMPT, 16))
    assert runs[0].new_tokens.tolist() == runs[1].new_tokens.tolist()
    assert runs[0].accept_lengths == runs[1].accept_lengths


def _import_same(head, target, folder):
    assert interop.detect_format(folder) == "deepspec"
    back = heads.from_pretrained(folder, target)  # the one door: foreign folders go to interop
    assert type(back) is DSparkHead and back.config == head.config
    with torch.no_grad():
        _same_tensors(head, back)
        _same_chains(head, back, target)
        _same_generation(head, back, target)
    return back


# ---- schema and imports -----------------------------------------------------------------------


def test_the_folder_written_follows_the_pinned_schema(target, tmp_path):
    head = _dspark(target)
    folder = write_deepspec(tmp_path / "d", target, head)
    spec = head.spec
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    want = deepspec_schema(target.vocab_size, 2, len(IDS), spec.intermediate_size, q, kv,
                           spec.head_dim, RANK, True)  # fmt: skip
    written = interop.load_tensors(folder)
    assert {k: tuple(v.shape) for k, v in written.items()} == want
    doc = json.loads((folder / "config.json").read_text())
    assert doc["hidden_size"] == H and doc["vocab_size"] == target.vocab_size  # the target's
    assert {k: doc[k] for k in ("architectures", "num_target_layers", "num_hidden_layers",
                                "block_size", "mask_token_id", "target_layer_ids",
                                "enable_confidence_head", "confidence_head_with_markov",
                                "markov_rank", "markov_head_type")} == {
        "architectures": ["Qwen3DSparkModel"], "num_target_layers": 4, "num_hidden_layers": 2,
        "block_size": BLOCK, "mask_token_id": MASK, "target_layer_ids": IDS,
        "enable_confidence_head": True, "confidence_head_with_markov": True,
        "markov_rank": RANK, "markov_head_type": "vanilla"}  # fmt: skip


@pytest.mark.parametrize("learn_mask", [False, True])
def test_a_deepspec_dspark_imports_as_the_same_head(learn_mask, target, tmp_path):
    """learn_mask=false: the MASK row equals the target's, as in DeepSpec's own checkpoints
    (a frozen copy of the target's table), so the import embeds the mask token exactly as
    DeepSpec does; a MASK row that differs comes back as a learned MASK vector."""
    head = _dspark(target, learn_mask=learn_mask)
    back = _import_same(head, target, write_deepspec(tmp_path / "d", target, head))
    assert back.config.learn_mask is learn_mask and back.config.num_anchors == 16


def test_without_a_confidence_head(target, tmp_path):
    head = _dspark(target, enable_confidence_head=False, learn_mask=False)
    back = _import_same(head, target, write_deepspec(tmp_path / "d", target, head))
    assert back.confidence_head is None


def test_a_deepspec_dflash_imports_without_markov_and_confidence_heads(target, tmp_path):
    head = _dflash(target, learn_mask=False)
    folder = write_deepspec(tmp_path / "d", target, head)
    doc = json.loads((folder / "config.json").read_text())
    assert doc["markov_rank"] == 0 and not doc["enable_confidence_head"]
    assert "markov_head_type" not in doc and "confidence_head_with_markov" not in doc
    assert not any(k.startswith(("markov_head.", "confidence_head.")) for k in
                   interop.load_tensors(folder))  # fmt: skip
    back = _import_same(head, target, folder)
    assert back.markov_head is None and back.confidence_head is None
    assert back.max_draft_depth == BLOCK  # still anchor-sampled: every slot drafts


def test_a_rank_zero_head_trains_saves_and_refuses_the_speculators_layout(tmp_path):
    target = _target()
    head = _dflash(target).train()
    ids = torch.randint(4, target.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    out = head.loss(batch, target.features(ids, torch.ones_like(ids), head.feature_layers()))
    out.loss.backward()
    assert head.fc.weight.grad.abs().sum() > 0 and "confidence/bce" not in out.stats
    head.save_pretrained(tmp_path / "native")
    back = heads.from_pretrained(tmp_path / "native", target)
    assert back.config == head.config and back.markov_head is None
    with pytest.raises(ValueError, match=r"markov_rank=0.*--format native"):
        interop.export_draft(head, target, "speculators", tmp_path / "s")


def test_rank_zero_config_rules():
    with pytest.raises(ValueError, match="markov_rank=-1"):
        DSparkConfig(markov_rank=-1)
    with pytest.raises(ValueError, match="markov_rank=0.*enable_confidence_head=false"):
        DSparkConfig(markov_rank=0)
    assert DSparkConfig(markov_rank=0, enable_confidence_head=False).markov_rank == 0


# ---- refusals ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    return _target()


def _edited(tmp_path, target, head, **changes):
    doc = deepspec_config(target, head) | changes
    return write_deepspec(tmp_path / "d", target, head, doc=doc)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"markov_head_type": "gated"}, "markov_head_type='gated'"),
        ({"confidence_head_with_markov": False}, "confidence_head_with_markov=false"),
        ({"target_layer_ids": [-1, 2]}, "include -1"),
        ({"target_layer_ids": [0, 3]}, "do not name layers"),
        ({"num_target_layers": 6}, "6-layer target"),
        ({"num_attention_heads": 2}, "draft layer differs"),
        ({"attention_bias": True}, "attention_bias=true"),
    ],
)
def test_layouts_dspark_cannot_represent_are_refused(changes, match, llama, tmp_path):
    folder = _edited(tmp_path, llama, _dspark(llama), **changes)
    with pytest.raises(HeadMismatchError, match=match):
        interop.import_draft(folder, llama)


def test_a_confidence_head_without_a_markov_head_is_refused(llama, tmp_path):
    head = _dflash(llama)
    tensors = deepspec_tensors(llama, head) | {
        "confidence_head.proj.weight": torch.zeros(1, H),
        "confidence_head.proj.bias": torch.zeros(1),
    }
    doc = deepspec_config(llama, head) | {"enable_confidence_head": True}
    folder = write_deepspec(tmp_path / "d", llama, head, doc=doc, tensors=tensors)
    with pytest.raises(HeadMismatchError, match="confidence head without a Markov head"):
        interop.import_draft(folder, llama)


def test_drafts_for_another_target_are_refused(llama, tmp_path):
    head = _dspark(llama)
    folder = write_deepspec(tmp_path / "d", llama, head)
    wider = Target.from_model(make_llama(layers=4, hidden=32), make_tokenizer(), name_or_path="w")
    with pytest.raises(HeadMismatchError, match="hidden_size"):
        interop.import_draft(folder, wider)
    deeper = Target.from_model(make_llama(layers=6), make_tokenizer(), name_or_path="deeper")
    with pytest.raises(HeadMismatchError, match="4-layer target"):
        interop.import_draft(folder, deeper)
    same_size = Target.from_model(make_llama(seed=9, layers=4), make_tokenizer(), name_or_path="o")
    with pytest.raises(HeadMismatchError, match="differs from the target's"):
        interop.import_draft(folder, same_size)  # its embed_tokens / lm_head copies differ


def test_a_trained_lm_head_or_a_damaged_file_is_refused(llama, tmp_path):
    head = _dspark(llama)
    tensors = deepspec_tensors(llama, head)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
    folder = write_deepspec(tmp_path / "a", llama, head, tensors=tensors)
    with pytest.raises(HeadMismatchError, match="lm_head.weight differs"):
        interop.import_draft(folder, llama)
    tensors = deepspec_tensors(llama, head)
    del tensors["markov_head.markov_w2.weight"]
    folder = write_deepspec(tmp_path / "b", llama, head, tensors=tensors)
    with pytest.raises(HeadMismatchError, match="lacks 1 tensors"):
        interop.import_draft(folder, llama)
