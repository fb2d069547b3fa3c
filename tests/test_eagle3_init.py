"""EAGLE-3's `head.init_from_target` (heads/eagle3_target.py): the starting draft computes the
target's own layer exactly (Llama), copies the weights it can (Qwen2 drops q/k/v biases), trains
from there, saves and loads without re-initialising, decodes losslessly, and says clearly when a
target has no decoder layers to copy."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import diverse, fit, make_llama

import heads
from eval.engine.drafting import make_proposer
from eval.engine.generator import SpeculativeGenerator
from eval.engine.tree_spec import resolve_tree
from eval.engine.verify import GreedyVerifier
from heads.draft_layer import DraftCache
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.eagle3_target import init_eagle3_from_target
from heads.target import Target


def _head(target, seed=0, **kw) -> Eagle3Head:
    torch.manual_seed(seed)
    kw.setdefault("draft_vocab_size", None)
    return Eagle3Head.for_target(Eagle3Config(**kw), target)


def _ids(T=12, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 256, (B, T), generator=g)


def test_the_starting_draft_is_the_target_layer_that_reads_the_deepest_feature(tokenizer):
    """Aux layers [0, 1] of a 3-layer Llama: the draft starts as decoder layer 1, so its first
    step maps hidden_states[1] to hidden_states[2] (that layer's real output) whatever tokens it
    is given, and its logits are the target's logit lens there."""
    model = diverse(make_llama(layers=3), std=0.2)
    target = Target.from_model(model, tokenizer, name_or_path="tiny3")
    head = _head(target, aux_layers=[0, 1], init_from_target=True).eval()
    ids = _ids()
    mask = torch.ones_like(ids)
    with torch.no_grad():
        states = model.model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        hidden = head.target_hidden(target.features(ids, mask, head.feature_layers()))
        assert torch.allclose(hidden, states[1], atol=1e-6)  # fc selects the deepest feature
        pos = torch.arange(12).expand(2, 12)
        for tokens in (ids, ids.flip(1)):  # the embedding half starts at zero
            out, logits = head.step(tokens, hidden, pos, DraftCache())
            assert torch.allclose(out, states[2], atol=1e-4)
            lens = model.lm_head(model.model.norm(states[2]))
            assert torch.allclose(logits, lens, atol=1e-3)
    # a random head is nowhere near it
    other = _head(target, aux_layers=[0, 1]).eval()
    with torch.no_grad():
        out, _ = other.step(ids, other.target_hidden({"aux": torch.cat(states[:2], -1)}), pos,
                            DraftCache())  # fmt: skip
    assert not torch.allclose(out, states[2], atol=1e-1)


def test_it_copies_the_weights_of_both_families(tiny_target):
    head = _head(tiny_target, init_from_target=True)
    deepest = max(head.config.aux_layers)
    src = tiny_target.model.base_model.layers[deepest]
    mine, H = head.layers[0], tiny_target.hidden_size
    for name in ("q_proj", "k_proj", "v_proj"):
        weight = getattr(mine.self_attn, name).weight
        assert torch.equal(weight[:, H:], getattr(src.self_attn, name).weight)
        assert not weight[:, :H].any()
    assert torch.equal(mine.self_attn.o_proj.weight, src.self_attn.o_proj.weight)
    assert torch.equal(mine.mlp.down_proj.weight, src.mlp.down_proj.weight)
    assert torch.equal(mine.hidden_norm.weight, src.input_layernorm.weight)
    assert torch.equal(head.norm.weight, tiny_target.model.base_model.norm.weight)
    slot = head.config.aux_layers.index(deepest)
    assert torch.equal(head.fc.weight[:, slot * H : (slot + 1) * H], torch.eye(H))
    assert head.fc.weight.abs().sum() == H  # nothing but the identity
    # off by default: the layer is random
    plain = _head(tiny_target)
    assert not plain.config.init_from_target
    assert not torch.equal(plain.layers[0].mlp.down_proj.weight, src.mlp.down_proj.weight)


def test_it_trains_saves_and_loads_without_reinitialising(tiny_llama, tmp_path):
    with torch.no_grad():
        tiny_llama.lm_head.weight.mul_(40.0)  # a sharp target: something to learn
    head = _head(tiny_llama, ttt_steps=3, init_from_target=True).train()
    ids = _ids(T=16)
    mask = torch.zeros_like(ids)
    mask[:, 4:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
    feats = tiny_llama.features(ids, batch["attention_mask"], head.feature_layers())
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    first, out = fit(head, batch, feats, opt)
    assert torch.isfinite(out.loss) and out.loss.item() < 0.6 * first
    head.eval().save_pretrained(tmp_path / "h")
    assert json.loads((tmp_path / "h" / "config.json").read_text())["config"]["init_from_target"]
    back = heads.from_pretrained(tmp_path / "h", tiny_llama)
    for (k, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), k  # the trained weights, not a fresh copy of the target's


def test_greedy_decoding_from_the_copied_layer_is_lossless():
    model = diverse(make_llama(hidden=32, layers=3))
    target = Target.from_model(model, None, name_or_path="tiny")
    prompt = torch.tensor([[2, 40, 17, 99, 5, 63, 120, 8]])
    want = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)[0, 8:]
    head = _head(target, init_from_target=True).eval()
    for tree in ([[0], [1], [0, 0], [0, 1], [0, 0, 0]], 3):
        gen = SpeculativeGenerator(model, make_proposer(head, resolve_tree(tree)), GreedyVerifier())
        assert gen.generate(prompt, 16).new_tokens.tolist() == want.tolist()


def test_a_target_without_decoder_layers_gets_one_clear_line(tiny_llama):
    head = _head(tiny_llama)
    odd = SimpleNamespace(model=SimpleNamespace(base_model=SimpleNamespace()))
    with pytest.raises(ValueError, match="head.init_from_target=false") as err:
        init_eagle3_from_target(head, odd)
    assert "\n" not in str(err.value)


def test_the_override_trains_and_resumes_end_to_end(tmp_path):
    from tests.test_experiments import _compose
    from train.run import run

    overrides = ["head.init_from_target=true", "evaluators=[]", "trainer.best_metric=null"]
    result = run(_compose("eagle3_tiny", overrides), run_dir=tmp_path)
    assert result.step == 2
    saved = json.loads((tmp_path / "head" / "config.json").read_text())["config"]
    assert saved["init_from_target"] is True
    more = run(_compose("eagle3_tiny", [*overrides, "trainer.max_steps=4"]), run_dir=tmp_path)
    assert more.step == 4
