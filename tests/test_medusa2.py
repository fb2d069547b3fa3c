"""Medusa-2 (heads/medusa2.py): heads + LoRA adapter trained together, on tiny random targets."""

from __future__ import annotations

import pytest
import torch
from conftest import make_llama, make_qwen2, make_tokenizer

from heads.medusa2 import Medusa2Config, Medusa2Head, is_adapted
from heads.target import Target
from train.optim import build_optimizer


def fresh(kind: str = "llama") -> Target:
    model = make_llama() if kind == "llama" else make_qwen2()
    return Target.from_model(model, make_tokenizer(), name_or_path=f"tiny-{kind}")


def batch(vocab: int = 256, length: int = 24, rows: int = 2, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, length), generator=g)
    mask = torch.zeros(rows, length, dtype=torch.long)
    mask[:, length // 3 :] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}


def config(**kw) -> Medusa2Config:
    return Medusa2Config(num_heads=2, lora_rank=4, **kw)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_only_adapter_and_heads_train_and_the_kl_starts_at_zero(kind):
    target = fresh(kind)
    original = {n: p.detach().clone() for n, p in target.model.named_parameters()}
    head = Medusa2Head.for_target(config(), target)
    assert is_adapted(target)
    trainable = [n for n, p in head.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or n.startswith("medusa.") for n in trainable)
    assert any("lora_" in n for n in trainable)
    out = head.loss(batch(), {})
    # LoRA's B starts at zero: the adapted target equals the original, so KL = 0 exactly
    kl_sum, count = out.stats["lm/kl"].tolist()
    assert count > 0 and abs(kl_sum) < 1e-5
    assert out.stats["lm/agree_original"][0] == count
    out.loss.backward()
    lora_grads = [p.grad for n, p in head.named_parameters() if "lora_" in n]
    assert any(g is not None and g.abs().sum() > 0 for g in lora_grads)  # heads' loss reaches it
    for name, p in target.model.named_parameters():  # the base weights never get gradients
        if "lora_" not in name:
            assert p.grad is None, name
    base = {n.replace("base_model.model.", "").replace(".base_layer", ""): p
            for n, p in head.adapted.named_parameters() if "lora_" not in n}  # fmt: skip
    for name, value in original.items():
        assert torch.equal(base[name], value), name


def test_training_moves_the_adapter_and_kl_then_measures_the_drift():
    torch.manual_seed(0)
    target = fresh()
    head = Medusa2Head.for_target(config(), target)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    b = batch()
    first = head.loss(b, {}).loss.item()
    for _ in range(8):
        opt.zero_grad()
        head.loss(b, {}).loss.backward()
        opt.step()
    out = head.loss(b, {})
    assert out.loss.item() < first
    assert out.stats["lm/kl"][0] > 0  # the adapter moved, and the KL term sees it


def test_lm_quality_is_next_token_cross_entropy():
    target = fresh()
    head = Medusa2Head.for_target(config(quality="lm"), target)
    b = batch()
    out = head.loss(b, {})
    logits = target.model(input_ids=b["input_ids"]).logits[:, :-1].float()
    labels = b["input_ids"][:, 1:]
    valid = b["loss_mask"][:, 1:].bool()
    ce = torch.nn.functional.cross_entropy(logits[valid], labels[valid], reduction="sum")
    assert torch.allclose(out.stats["lm/lm"][0], ce, rtol=1e-4)


def test_separate_learning_rates():
    from train.config import TrainerConfig

    target = fresh()
    head = Medusa2Head.for_target(config(adapter_lr=1e-5), target)
    opt = build_optimizer(head, TrainerConfig(lr=1e-3))
    lrs = {}
    names = {id(p): n for n, p in head.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            lrs[names[id(p)]] = group["lr"]
    assert {lr for n, lr in lrs.items() if "lora_" in n} == {1e-5}
    assert {lr for n, lr in lrs.items() if "lora_" not in n} == {1e-3}


def test_save_reload_adapts_a_fresh_target_identically(tmp_path):
    torch.manual_seed(0)
    target = fresh()
    head = Medusa2Head.for_target(config(), target)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    head.save_pretrained(tmp_path / "h")
    assert (tmp_path / "h" / "adapter" / "adapter_config.json").is_file()  # PEFT's layout too
    import heads

    other = fresh()
    loaded = heads.from_pretrained(tmp_path / "h", other)
    assert isinstance(loaded, Medusa2Head) and is_adapted(other)
    b = batch()
    with torch.no_grad():
        a = target.model(input_ids=b["input_ids"]).logits
        c = other.model(input_ids=b["input_ids"]).logits
        assert torch.allclose(a, c, atol=1e-6)  # the same adapted target
        h = torch.randn(3, target.hidden_size)
        assert torch.allclose(head(h), loaded(h))
        loaded.merge_into_target()  # merged weights: the same outputs, no LoRA at run time
        assert torch.allclose(other.model(input_ids=b["input_ids"]).logits, a, atol=1e-5)
    with pytest.raises(ValueError, match="already carries"):
        Medusa2Head.for_target(config(), other)


def test_greedy_decoding_with_the_adapted_target_is_lossless():
    """Speculative output equals HF generate of the *adapted* target (what Medusa-2 serves)."""
    from eval.engine.generator import SpeculativeGenerator
    from eval.engine.proposers import MedusaProposer
    from eval.engine.tree import build_tree
    from eval.engine.verify import GreedyVerifier

    torch.manual_seed(0)
    target = fresh()
    head = Medusa2Head.for_target(config(), target).eval()
    with torch.no_grad():
        for n, p in head.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)  # an adapter that changes the target's outputs
    prompt = torch.randint(4, 256, (1, 12))
    gen = SpeculativeGenerator(
        target.model, MedusaProposer(head, build_tree([[0], [1], [0, 0]])), GreedyVerifier()
    )
    out = gen.generate(prompt, 16)
    ref = target.model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    assert out.tokens.tolist() == ref.tolist()
    with torch.no_grad(), head.adapted.disable_adapter():
        plain = target.model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    assert plain.tolist() != ref.tolist()  # the adapter really changed the model


def test_config_is_checked():
    with pytest.raises(ValueError, match="quality"):
        Medusa2Config(quality="mse")
    with pytest.raises(ValueError, match="lora_target_modules"):
        Medusa2Config(lora_target_modules=[])
    with pytest.raises(ValueError, match="adapter_lr"):
        Medusa2Config(adapter_lr=0)
    with pytest.raises(ValueError, match="lora_target_modules"):
        Medusa2Head.for_target(Medusa2Config(lora_target_modules=["nope_proj"]), fresh())


def test_warm_start_from_medusa1_heads(tmp_path):
    from heads.base import HeadMismatchError
    from heads.medusa import MedusaConfig, MedusaHeads
    from train.run import init_head_weights

    target = fresh()
    medusa1 = MedusaHeads.for_target(MedusaConfig(num_heads=2), target)
    with torch.no_grad():
        for p in medusa1.parameters():
            p.add_(torch.randn_like(p))
    medusa1.save_pretrained(tmp_path / "m1")
    head = Medusa2Head.for_target(config(), target)
    init_head_weights(head, str(tmp_path / "m1"))
    for name, value in medusa1.state_dict().items():
        assert torch.equal(head.medusa.state_dict()[name], value), name
    # the adapter starts fresh: the adapted target still equals the original (LoRA B = 0)
    assert abs(head.loss(batch(), {}).stats["lm/kl"][0]) < 1e-5

    MedusaHeads.for_target(MedusaConfig(num_heads=3), fresh()).save_pretrained(tmp_path / "m3")
    with pytest.raises(HeadMismatchError, match="not in this head.*blocks.2"):
        init_head_weights(Medusa2Head.for_target(config(), fresh()), str(tmp_path / "m3"))
    with pytest.raises(FileNotFoundError, match="give a head folder"):
        init_head_weights(head, str(tmp_path))

    # a serving-engine layout (vLLM's Medusa) is imported first, then taken the same way
    from heads.interop import export_draft

    export_draft(medusa1, target, "medusa", tmp_path / "vllm")
    again = Medusa2Head.for_target(config(), fresh())
    init_head_weights(again, str(tmp_path / "vllm"), target)
    for name, value in medusa1.state_dict().items():
        assert torch.equal(again.medusa.state_dict()[name], value), name
