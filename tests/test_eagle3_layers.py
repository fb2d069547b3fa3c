"""EAGLE-3 with more than one draft layer (`head.num_layers`): the first layer reads
[embeddings; fused features], the rest are plain layers on its residual stream, as vLLM's
llama_eagle3 builds them. Parameters, the per-layer cache under drafting's crop and gather, a loss
that falls, save and load (old config.json files too), lossless greedy decoding,
init_from_target, the eagle3 and speculators exports and their import, the GGUF and OpenVINO
refusals, and the override end to end. The training-time-test unroll against drafting and the
cache against a full pass are tests/test_eagle3_options.py's, run there with two layers too."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import diverse, fit, make_llama

import heads
from data.errors import ConfigError, DraftsmithError
from eval.engine.drafting import make_proposer
from eval.engine.dynamic_tree import DynamicTreeConfig
from eval.engine.generator import SpeculativeGenerator
from eval.engine.tree_spec import resolve_tree
from eval.engine.verify import GreedyVerifier
from heads import interop
from heads.draft_layer import DraftCache
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.interop.gguf import gguf_source_format, spec_type_for
from heads.target import Target


def _head(target, seed=0, **kw) -> Eagle3Head:
    torch.manual_seed(seed)
    kw.setdefault("draft_vocab_size", None)
    return Eagle3Head.for_target(Eagle3Config(**kw), target)


def _batch(T=16, B=2, V=256, seed=0, start=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[:, start:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}


def _features(head, target, batch):
    return target.features(batch["input_ids"], batch["attention_mask"], head.feature_layers())


# ---- parameters and the cache ----------------------------------------------------------------


def test_each_extra_layer_is_one_plain_decoder_layer(tiny_llama):
    H = tiny_llama.hidden_size
    one, three = _head(tiny_llama), _head(tiny_llama, num_layers=3)
    assert len(three.layers) == 3 and len(one.layers) == 1
    extra = set(three.state_dict()) - set(one.state_dict())
    assert {k.split(".")[1] for k in extra} == {"1", "2"}
    assert not any("hidden_norm" in k for k in extra)  # only the first layer reads features
    assert three.layers[1].self_attn.q_proj.in_features == H
    assert three.layers[0].self_attn.q_proj.in_features == 2 * H
    layer = sum(p.numel() for p in three.layers[1].parameters())
    count = lambda h: sum(p.numel() for p in h.parameters())  # noqa: E731
    assert count(three) - count(one) == 2 * layer


def test_config_refuses_no_layers():
    with pytest.raises(ValueError, match="head.num_layers=0"):
        Eagle3Config(num_layers=0)


def test_steps_with_a_cache_equal_a_full_pass_and_rollback_keeps_layers_aligned(tiny_llama):
    head = diverse(_head(tiny_llama, num_layers=2), std=0.3, seed=2).eval()
    batch = _batch(T=12)
    hidden = head.target_hidden(_features(head, tiny_llama, batch))
    ids = batch["input_ids"]
    tokens = torch.cat([ids[:, 1:], torch.zeros(2, 1, dtype=torch.long)], 1)
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        full_h, full_l = head.step(tokens, hidden, pos, DraftCache())
        cache, parts = DraftCache(), []
        for a, b in [(0, 5), (5, 6), (6, 12)]:
            parts.append(head.step(tokens[:, a:b], hidden[:, a:b], pos[:, a:b], cache))
        assert torch.allclose(torch.cat([p[0] for p in parts], 1), full_h, rtol=1e-4, atol=1e-4)
        assert torch.allclose(torch.cat([p[1] for p in parts], 1), full_l, rtol=1e-4, atol=1e-4)
        # the second layer's cache differs from the first's and follows it through a rollback
        assert cache.layer(1).length == cache.length == 12
        assert not torch.allclose(cache.layer(1).keys, cache.keys)
        cache.crop(6)
        assert cache.layer(1).length == 6
        again = head.step(tokens[:, 6:], hidden[:, 6:], pos[:, 6:], cache)
        assert torch.allclose(again[1], full_l[:, 6:], rtol=1e-4, atol=1e-4)
        # drafting a small tree after the 6-token prefix: nodes a and b at position 6, c a child
        # of b; the second layer's entries depend on what each node attended to, so keeping the
        # path [b, c] must keep both layers' entries of that path
        cache.crop(6)
        nodes = torch.tensor([6, 7, 8])
        tree = torch.ones(3, 9, dtype=torch.bool)
        tree[:, 6:] = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 1, 1]], dtype=torch.bool)
        where = torch.tensor([[6, 6, 7]]).expand(2, 3)
        head.step(tokens[:, nodes], hidden[:, nodes], where, cache, tree[None, None])
        cache.gather(torch.tensor([0, 1, 2, 3, 4, 5, 7, 8]))
        assert cache.layer(1).length == cache.length == 8
        # the next row on that path scores as a fresh causal pass over the path does
        path = torch.tensor([0, 1, 2, 3, 4, 5, 7, 8, 9])
        at = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8]).expand(2, 9)
        want = head.step(tokens[:, path], hidden[:, path], at, DraftCache())[1]
        got = head.step(tokens[:, 9:10], hidden[:, 9:10], at[:, 8:], cache)[1]
        assert torch.allclose(got, want[:, -1:], rtol=1e-4, atol=1e-4)
        # with only the first layer's cache gathered, the second layer would read stale rows
        stale = DraftCache()
        head.step(tokens[:, :6], hidden[:, :6], pos[:, :6], stale)
        head.step(tokens[:, nodes], hidden[:, nodes], where, stale, tree[None, None])
        keep = torch.tensor([0, 1, 2, 3, 4, 5, 7, 8])
        stale.keys, stale.values = stale.keys[:, :, keep], stale.values[:, :, keep]
        stale.layer(1).crop(8)
        bad = head.step(tokens[:, 9:10], hidden[:, 9:10], at[:, 8:], stale)[1]
        assert not torch.allclose(bad, want[:, -1:], rtol=1e-4, atol=1e-4)


# ---- training and checkpoints ----------------------------------------------------------------


def test_loss_falls_and_the_second_layer_learns(tiny_llama):
    with torch.no_grad():
        tiny_llama.lm_head.weight.mul_(40.0)  # sharpen the target: something to learn
    head = _head(tiny_llama, ttt_steps=3, num_layers=2).train()
    before = head.layers[1].mlp.down_proj.weight.clone()
    batch = _batch()
    feats = _features(head, tiny_llama, batch)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    torch.manual_seed(0)
    first, out = fit(head, batch, feats, opt)
    assert torch.isfinite(out.loss) and out.loss.item() < 0.6 * first
    assert not torch.equal(head.layers[1].mlp.down_proj.weight, before)


def test_save_and_load_round_trip_and_old_files_load_as_one_layer(tiny_llama, tmp_path):
    head = diverse(_head(tiny_llama, num_layers=2), std=0.3, seed=2).eval()
    head.save_pretrained(tmp_path / "h")
    assert json.loads((tmp_path / "h" / "config.json").read_text())["config"]["num_layers"] == 2
    back = heads.from_pretrained(tmp_path / "h", tiny_llama).eval()
    assert back.config == head.config and len(back.layers) == 2
    for (k, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    one = _head(tiny_llama)
    one.save_pretrained(tmp_path / "old")
    file = tmp_path / "old" / "config.json"
    doc = json.loads(file.read_text())
    del doc["config"]["num_layers"]  # a config.json written before the option
    file.write_text(json.dumps(doc))
    assert len(heads.from_pretrained(tmp_path / "old", tiny_llama).layers) == 1


# ---- decoding and init_from_target -----------------------------------------------------------


def test_greedy_decoding_with_two_layers_is_lossless():
    model = diverse(make_llama(hidden=32))
    target = Target.from_model(model, None, name_or_path="tiny")
    prompt = torch.tensor([[2, 40, 17, 99, 5, 63, 120, 8]])
    want = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)[0, 8:]
    torch.manual_seed(3)
    config = Eagle3Config(draft_vocab_size=target.vocab_size // 2, num_layers=2)
    counts = torch.arange(target.vocab_size).flip(0)
    head = Eagle3Head.for_target(config, target, token_counts=counts)
    head = diverse(head, std=0.3, seed=4).eval()
    dynamic = DynamicTreeConfig(depth=4, top_k=3, total_tokens=10)
    for tree in ([[0], [1], [0, 0], [0, 1], [0, 0, 0]], 3, dynamic):  # a tree, a chain, dynamic
        gen = SpeculativeGenerator(model, make_proposer(head, resolve_tree(tree)), GreedyVerifier())
        assert gen.generate(prompt, 16).new_tokens.tolist() == want.tolist()


def test_init_from_target_stacks_the_target_layers_above_the_deepest_feature(tokenizer):
    """Aux layers [0, 1] of a 3-layer Llama and two draft layers: they start as decoder layers 1
    and 2, so the first step reproduces the target's own logits whatever tokens it is given."""
    model = diverse(make_llama(layers=3), std=0.2)
    target = Target.from_model(model, tokenizer, name_or_path="tiny3")
    head = _head(target, aux_layers=[0, 1], init_from_target=True, num_layers=2).eval()
    ids = _batch(T=12)["input_ids"]
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        hidden = head.target_hidden(target.features(ids, mask, head.feature_layers()))
        pos = torch.arange(12).expand(2, 12)
        for tokens in (ids, ids.flip(1)):
            assert torch.allclose(head.step(tokens, hidden, pos, DraftCache())[1], want, atol=1e-3)
    src, mine = model.model.layers[2], head.layers[1]
    assert torch.equal(mine.self_attn.q_proj.weight, src.self_attn.q_proj.weight)
    assert torch.equal(mine.input_layernorm.weight, src.input_layernorm.weight)


# ---- serving layouts -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_exports_for_vllm_name_the_layers_and_import_back(tiny_target, tmp_path, fmt):
    counts = torch.arange(tiny_target.vocab_size).flip(0)
    torch.manual_seed(0)
    config = Eagle3Config(num_layers=2, draft_vocab_size=50)
    head = Eagle3Head.for_target(config, tiny_target, token_counts=counts)
    head = diverse(head, std=0.3, seed=2).eval()
    config = interop.export_draft(head, tiny_target, fmt, tmp_path / fmt)
    layer_doc = config.get("transformer_layer_config", config)
    assert layer_doc["num_hidden_layers"] == 2
    back = interop.import_draft(tmp_path / fmt, tiny_target).eval()
    assert len(back.layers) == 2 and back.config.num_layers == 2
    for (k, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    # an engine-written folder (no draftsmith block) still says how many layers
    file = tmp_path / fmt / "config.json"
    doc = {k: v for k, v in json.loads(file.read_text()).items() if k != "draftsmith"}
    file.write_text(json.dumps(doc))
    assert len(interop.import_draft(tmp_path / fmt, tiny_target).layers) == 2


def test_llama_cpp_and_openvino_refuse_more_than_one_layer(tiny_llama, tokenizer):
    assert gguf_source_format(_head(tiny_llama)) == "eagle3"
    head = _head(tiny_llama, num_layers=2)
    for call in (gguf_source_format, spec_type_for):
        with pytest.raises(ConfigError, match="head.num_layers=2") as err:
            call(head)
        assert isinstance(err.value, DraftsmithError) and "\n" not in str(err.value)
        assert "head.num_layers=1" in str(err.value)
    from heads.interop.openvino import export_openvino_draft

    target = Target.from_model(make_llama(layers=4), tokenizer, name_or_path="tiny-llama-4")
    two = _head(target, aux_layers=[1, 2, 3], num_layers=2)
    with pytest.raises(ConfigError, match="head.num_layers=2.*one draft layer") as err:
        export_openvino_draft(two, target, "/nonexistent/never-written")
    assert "\n" not in str(err.value)


# ---- the override, end to end ----------------------------------------------------------------


def test_the_override_trains_and_resumes_end_to_end(tmp_path):
    from tests.test_experiments import _compose
    from train.run import run

    overrides = ["head.num_layers=2", "evaluators=[]", "trainer.best_metric=null"]
    result = run(_compose("eagle3_tiny", overrides), run_dir=tmp_path)
    assert result.step == 2 and "val/step0/chain_top1" in result.val_metrics
    saved = json.loads((tmp_path / "head" / "config.json").read_text())["config"]
    assert saved["num_layers"] == 2
    more = run(_compose("eagle3_tiny", [*overrides, "trainer.max_steps=4"]), run_dir=tmp_path)
    assert more.step == 4
