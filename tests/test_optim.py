"""trainer.optimizer: AdamW, or Muon on a draft's hidden weight matrices with AdamW on the rest
(train/optim.py). Which parameters go where, the lr schedule reaching both, a loss that falls,
and a resumed run that equals an uninterrupted one bit for bit, optimizer state included."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import fit

import heads
import tests.test_checkpoint as tc
from data.errors import ConfigError
from heads.dspark import DSparkConfig
from heads.eagle3 import Eagle3Config
from heads.medusa import MedusaConfig
from tests._dummy_head import DummyHead
from train import checkpoint as ckpt
from train.config import TrainerConfig
from train.optim import MultiOptimizer, build_optimizer, build_scheduler


def _eagle3(target, **kw):
    torch.manual_seed(0)
    return heads.build_head(Eagle3Config(draft_vocab_size=None, ttt_steps=2, **kw), target)


def _names(head, opt) -> set[str]:
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    return {n for n, p in head.named_parameters() if id(p) in ids}


def test_adamw_is_the_default_and_unchanged(tiny_llama):
    head = _eagle3(tiny_llama)
    opt = build_optimizer(head, TrainerConfig(lr=1e-3, weight_decay=0.1))
    assert type(opt) is torch.optim.AdamW
    decay = {g["weight_decay"] for g in opt.param_groups for p in g["params"] if p.ndim == 2}
    assert decay == {0.1}
    assert _names(head, opt) == {n for n, _ in head.named_parameters()}


def test_muon_takes_the_hidden_matrices_of_an_eagle3_draft(tiny_llama):
    head = _eagle3(tiny_llama, fc_norm=True)
    cfg = TrainerConfig(lr=1e-3, optimizer="muon", muon_lr=2e-2, muon_weight_decay=0.1)
    opt = build_optimizer(head, cfg)
    assert isinstance(opt, MultiOptimizer) and list(opt.optimizers) == ["muon", "adamw"]
    muon, adamw = opt.optimizers["muon"], opt.optimizers["adamw"]
    assert type(muon) is torch.optim.Muon and type(adamw) is torch.optim.AdamW
    hidden = {"fc.weight"} | {
        f"layers.0.{m}.weight"
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    }  # fmt: skip
    assert _names(head, muon) == hidden
    # the output head's rows are per-token vectors; norms (fc_norm included) are vectors
    rest = _names(head, adamw)
    assert "lm_head.weight" in rest and "fc_norm.0.weight" in rest and "norm.weight" in rest
    assert rest | hidden == {n for n, _ in head.named_parameters()} and not rest & hidden
    assert {g["lr"] for g in muon.param_groups} == {2e-2}
    assert {g["weight_decay"] for g in muon.param_groups} == {0.1}
    assert {g["lr"] for g in adamw.param_groups} == {1e-3}
    assert opt.param_groups == muon.param_groups + adamw.param_groups
    same = build_optimizer(head, TrainerConfig(lr=1e-3, optimizer="muon"))  # muon_lr null: lr
    assert {g["lr"] for g in same.param_groups} == {1e-3}


def test_muon_leaves_vocabulary_tables_and_tiny_matrices_to_adamw(tiny_llama):
    cfg = TrainerConfig(optimizer="muon")
    medusa = heads.build_head(MedusaConfig(draft_vocab_size=None), tiny_llama)
    opt = build_optimizer(medusa, cfg)
    assert all(n.startswith("blocks.") for n in _names(medusa, opt.optimizers["muon"]))
    assert {n for n in _names(medusa, opt.optimizers["adamw"]) if n.startswith("proj")}
    dspark = heads.build_head(DSparkConfig(), tiny_llama)
    rest = _names(dspark, build_optimizer(dspark, cfg).optimizers["adamw"])
    assert {"markov_head.markov_w1.weight", "confidence_head.proj.weight"} <= rest


def test_muon_refusals(tiny_llama):
    head = _eagle3(tiny_llama)
    with pytest.raises(ConfigError, match="not supported under FSDP"):
        build_optimizer(head, TrainerConfig(optimizer="muon"), sharded=True)
    table = torch.nn.Linear(8, 256)  # only a vocabulary table: nothing for Muon
    table.draft_vocab_size = 256
    with pytest.raises(ConfigError, match="no hidden weight matrices"):
        build_optimizer(table, TrainerConfig(optimizer="muon"))
    with pytest.raises(ConfigError, match="optimizer='sgd'"):
        TrainerConfig(optimizer="sgd")
    with pytest.raises(ConfigError, match="muon_lr"):
        TrainerConfig(muon_lr=0)
    with pytest.raises(ConfigError, match="muon_momentum"):
        TrainerConfig(muon_momentum=1.0)
    with pytest.raises(ConfigError, match="muon_adjust_lr_fn"):
        TrainerConfig(muon_adjust_lr_fn="other")


def test_the_schedule_reaches_both_and_state_round_trips(tiny_llama):
    """The lr schedule sets both optimizers' lr (also after load_state_dict replaced their
    groups), and a copy restored from state_dict continues exactly as the original."""
    head = _eagle3(tiny_llama)
    cfg = TrainerConfig(lr=1e-3, optimizer="muon", muon_lr=1e-2)
    opt = build_optimizer(head, cfg)
    sched = build_scheduler(opt, warmup=2, total=6, min_ratio=0.0)
    grads = {n: torch.randn_like(p) for n, p in head.named_parameters()}

    def step(h, o, s):
        for n, p in h.named_parameters():
            p.grad = grads[n].clone()
        o.step()
        s.step()

    step(head, opt, sched)
    lrs = [
        g["lr"] for g in opt.optimizers["muon"].param_groups + opt.optimizers["adamw"].param_groups
    ]
    assert lrs[0] == pytest.approx(1e-2) and lrs[-1] == pytest.approx(1e-3)  # warmup: 2 of 2
    twin = copy.deepcopy(head)
    twin_opt = build_optimizer(twin, cfg)
    twin_sched = build_scheduler(twin_opt, warmup=2, total=6, min_ratio=0.0)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    twin_sched.load_state_dict(sched.state_dict())
    assert twin_opt.param_groups == twin_opt._inner_groups()  # re-linked
    for _ in range(2):
        step(head, opt, sched)
        step(twin, twin_opt, twin_sched)
    for (n, a), (_, b) in zip(head.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    assert twin_opt.optimizers["muon"].param_groups[0]["lr"] < 1e-2  # the cosine moved it
    with pytest.raises(ConfigError, match="another trainer.optimizer"):
        twin_opt.load_state_dict(torch.optim.AdamW(head.parameters()).state_dict())


def test_muon_training_lowers_the_loss(tiny_llama):
    from tests.test_eagle3_options import _batch, _features

    with torch.no_grad():
        tiny_llama.lm_head.weight.mul_(40.0)
    head = _eagle3(tiny_llama).train()
    opt = build_optimizer(head, TrainerConfig(lr=3e-3, optimizer="muon", muon_lr=2e-2))
    batch = _batch()
    feats = _features(head, tiny_llama, batch)
    first, out = fit(head, batch, feats, opt)
    assert torch.isfinite(out.loss) and out.loss.item() < 0.6 * first


@pytest.fixture(scope="module")
def target():
    return tc.make_target()


def _optimizer_files(run_dir, step):
    path = run_dir / "checkpoints" / f"step_{step}" / ckpt.OPTIMIZER_FILE
    return torch.load(path, weights_only=True)["optimizer"]


def _assert_same(a, b, where="optimizer"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_muon_resume_is_bit_exact(target, tmp_path):
    """6 steps straight vs 3, a new process-like restart, 3 more: the same weights, losses and
    optimizer state (Muon's momentum buffers and AdamW's moments) at step 6."""
    muon = dict(optimizer="muon", muon_lr=3e-2)
    straight, _ = tc.run(target, tmp_path / "straight", **muon)
    _, first = tc.run(target, tmp_path / "resumed", stop_at=3, **muon)
    assert first.stopped_early and first.step == 3
    saved = _optimizer_files(tmp_path / "resumed", 3)
    assert set(saved) == {"muon", "adamw"}
    assert saved["muon"]["state"] and saved["adamw"]["state"]  # both hold moments to restore
    assert all("momentum_buffer" in s for s in saved["muon"]["state"].values())
    head = DummyHead(dropout=0.1, seed=99)
    resumed, second = tc.run(target, tmp_path / "resumed", head=head, **muon)
    assert second.step == 6
    tc.assert_same_weights(straight, resumed)
    assert tc.train_losses(tmp_path / "resumed") == tc.train_losses(tmp_path / "straight")
    _assert_same(
        _optimizer_files(tmp_path / "straight", 6), _optimizer_files(tmp_path / "resumed", 6)
    )
    # and the optimizer mattered: AdamW gives other weights
    adam, _ = tc.run(target, tmp_path / "adamw")
    assert not torch.equal(adam.proj.weight, straight.proj.weight)


def test_resume_refuses_a_changed_optimizer(target, tmp_path):
    tc.run(target, tmp_path / "m", stop_at=3, optimizer="muon")
    with pytest.raises(ckpt.CheckpointError, match=r'trainer\.optimizer: "muon" -> "adamw"'):
        tc.run(target, tmp_path / "m", optimizer="adamw")
    # allowed config changes still cannot pour one optimizer's state into the other
    with pytest.raises(ckpt.CheckpointError, match="adamw, muon .*trainer.optimizer=muon"):
        tc.run(target, tmp_path / "m", optimizer="adamw", allow_config_change=True)
    tc.run(target, tmp_path / "a", stop_at=3)
    with pytest.raises(ConfigError, match="another trainer.optimizer"):
        tc.run(target, tmp_path / "a", optimizer="muon", allow_config_change=True)
