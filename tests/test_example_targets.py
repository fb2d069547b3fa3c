"""Per-example training targets derived once from cached features (EAGLE-3's target greedy
tokens), kept for later epochs, and the CPU bf16 training step."""

from __future__ import annotations

import signal
from functools import partial

import pytest
import torch
from test_packing import build, fresh_target, loss_and_grads, make_examples, with_features

from data.dataset import collate, pack_examples
from train.config import TrainerConfig
from train.features import ExampleTargets, with_example_targets
from train.loop import Trainer


def derived(head, examples):
    return [{**e, **head.example_targets(e)} for e in examples]


def test_the_derived_tokens_are_the_targets_greedy_tokens():
    target = fresh_target()
    examples = make_examples([14, 9, 11])
    head = build("eagle3", target, examples)
    for example in derived(head, with_features(head, target, examples)):
        ids = example["input_ids"][None]
        with torch.no_grad():
            greedy = target.model(input_ids=ids).logits[0].argmax(-1)
        assert example["target_argmax"].dtype == torch.int32
        assert torch.equal(example["target_argmax"].long(), greedy)


@pytest.mark.parametrize("pack", [None, 24])
def test_derived_targets_give_the_loss_computed_per_batch(pack):
    target = fresh_target()
    examples = make_examples([14, 9, 11, 5, 16, 7])
    head = build("eagle3", target, examples)
    plain = with_features(head, target, examples)
    rows = (lambda xs: pack_examples(xs, pack)) if pack else (lambda xs: xs)
    per_batch = collate(rows(plain))
    kept = collate(rows(derived(head, plain)))
    assert "target_argmax" in kept and "target_argmax" not in per_batch
    out_a, grads_a = loss_and_grads(head, per_batch, target)
    out_b, grads_b = loss_and_grads(head, kept, target)
    torch.testing.assert_close(out_b.loss, out_a.loss, rtol=1e-6, atol=1e-7)
    for name, pair in out_a.stats.items():
        assert out_b.stats[name][1] == pair[1], name  # the same positions count
    # the mask is not vacuous: with 64 of 256 tokens drafted, some labels are dropped
    labels = int((per_batch["loss_mask"][:, 1:] * per_batch["attention_mask"][:, :-1]).sum())
    assert 0 < int(out_a.stats["step0/top1"][1]) < labels
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_batch_with_wrong_derived_tokens_changes_the_loss():
    """The loss reads the batch's tokens: swapping them for others moves which rows count."""
    target = fresh_target()
    examples = make_examples([14, 9, 11, 5])
    head = build("eagle3", target, examples)
    batch = collate(derived(head, with_features(head, target, examples)))
    outside = int((~head.t2d).nonzero()[0])  # a token the draft cannot propose
    wrong = {**batch, "target_argmax": torch.full_like(batch["target_argmax"], outside)}
    right, _ = loss_and_grads(head, batch, target)
    swapped, _ = loss_and_grads(head, wrong, target)
    assert int(swapped.stats["step0/top1"][1]) == 0 < int(right.stats["step0/top1"][1])


class CountingHead(torch.nn.Module):
    def __init__(self, device="cpu"):
        super().__init__()
        self.register_buffer("lm_head", torch.zeros(1, device=device))
        self.calls = 0

    def example_targets(self, example):
        self.calls += 1
        return {"target_argmax": example["input_ids"].to(torch.int32) + 1}


def test_example_targets_are_derived_once_and_kept():
    examples = make_examples([5, 7, 4])
    head = CountingHead()
    data = with_example_targets(examples, head)
    assert isinstance(data, ExampleTargets) and len(data) == 3
    for _ in range(3):  # three epochs
        for i in range(len(data)):
            got = data[i]
            assert torch.equal(got["target_argmax"], examples[i]["input_ids"].to(torch.int32) + 1)
            assert torch.equal(got["input_ids"], examples[i]["input_ids"])
    assert head.calls == 3
    assert "target_argmax" not in examples[0]  # the source examples are not changed
    # a head that derives nothing gets its dataset back unwrapped
    assert with_example_targets(examples, object()) is examples
    assert with_example_targets(None, head) is None


@pytest.fixture
def sigchld_restored():
    """torch's DataLoader, on its first worker, installs a Python SIGCHLD handler and keeps it for
    the rest of the process. In one test process with OpenVINO loaded later (test_openvino.py),
    the next child to exit killed the whole run: a SIGSEGV from the kernel (si_code SI_KERNEL,
    the main thread in waitpid) while delivering that handler, CI's exit 139. Without either the
    handler or OpenVINO it does not happen, so this test gives the old disposition back."""
    before = signal.getsignal(signal.SIGCHLD)
    yield
    signal.signal(signal.SIGCHLD, before)


@pytest.mark.parametrize("device, derived", [("cpu", True), ("meta", False)])
def test_dataloader_workers_derive_only_for_a_cpu_head(device, derived, sigchld_restored):
    """A forked worker must not touch an accelerator (here "meta" stands in for one): it leaves
    the tokens to the loss, which computes them per batch on the head's device."""
    examples = make_examples([5, 7, 4, 6])
    data = with_example_targets(examples, CountingHead(device))
    loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=1, collate_fn=collate)
    batches = list(loader)
    assert len(batches) == 2
    assert all(("target_argmax" in b) == derived for b in batches)


def test_a_head_without_a_reduced_vocabulary_derives_nothing():
    target = fresh_target()
    examples = make_examples([6, 8])
    head = build("eagle3", target, examples)
    head.config.mask_outside_vocab = False
    assert head.example_targets(with_features(head, target, examples)[0]) == {}
    head.config.mask_outside_vocab = True
    assert head.example_targets(examples[0]) == {}  # no cached features: nothing to derive from


def trainer(head, target, examples, tmp_path, **overrides):
    base = dict(lr=1e-3, max_steps=3, batch_size=2, log_every=1, progress=False, seed=0)
    return Trainer(
        head,
        TrainerConfig(**{**base, **overrides}),
        tmp_path,
        train_dataset=examples,
        collate_fn=partial(collate, pad_id=0),
        target=target,
        val_dataset=examples[:2],
    )


def test_the_trainer_derives_eagle3_targets_and_trains_on_them(tmp_path):
    target = fresh_target()
    examples = make_examples([10, 12, 8, 14, 9, 11])
    head = build("eagle3", target, examples).train()
    features = with_features(head, target, examples)
    run = trainer(head, target, features, tmp_path / "eagle3", pack_tokens=32)
    assert isinstance(run.train_dataset, ExampleTargets)
    result = run.fit()
    assert result.step == 3
    assert len(run.train_dataset._memo) == len(examples)  # every example derived, once
    medusa = build("medusa", target, examples).train()
    plain = trainer(medusa, target, features, tmp_path / "medusa")
    assert plain.train_dataset is features


def test_training_with_loader_workers_gives_sigchld_back(tmp_path, monkeypatch):
    """Trainer.fit with num_workers > 0 leaves the process's SIGCHLD disposition as it found it:
    torch's worker handler, left installed, crashed a later OpenVINO user of the process."""
    from torch.utils.data._utils import signal_handling

    monkeypatch.setattr(signal_handling, "_SIGCHLD_handler_set", False)  # as in a fresh process
    before = signal.getsignal(signal.SIGCHLD)
    try:
        target = fresh_target()
        examples = make_examples([10, 12, 8, 14])
        head = build("medusa", target, examples).train()
        features = with_features(head, target, examples)
        installed = []
        real_set = signal_handling._set_SIGCHLD_handler

        def spy():
            real_set()
            installed.append(signal.getsignal(signal.SIGCHLD))

        monkeypatch.setattr(signal_handling, "_set_SIGCHLD_handler", spy)
        result = trainer(head, target, features, tmp_path, num_workers=1).fit()
        assert result.step == 3
        assert installed and installed[0] is not before  # torch did install its own
        assert signal.getsignal(signal.SIGCHLD) is before
    finally:
        signal.signal(signal.SIGCHLD, before)


def test_bf16_mixed_precision_trains_under_cpu_autocast(tmp_path):
    target = fresh_target()
    examples = make_examples([10, 12, 8, 14])
    head = build("eagle3", target, examples).train()
    seen = []
    loss = head.loss

    def spy(batch, features):
        seen.append(torch.is_autocast_enabled("cpu"))
        return loss(batch, features)

    head.loss = spy
    features = with_features(head, target, examples)
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    result = trainer(head, target, features, tmp_path, mixed_precision="bf16").fit()
    assert result.step == 3 and seen and all(seen[:3])
    assert all(p.dtype == torch.float32 for p in head.parameters())  # the weights stay fp32
    assert any(not torch.equal(before[n], p) for n, p in head.named_parameters())
    assert result.train_loss is not None and torch.isfinite(torch.tensor(result.train_loss))
    # the same process may train again in full precision afterwards (Accelerate keeps one
    # precision per process unless the loop starts a fresh state)
    seen.clear()
    again = trainer(head, target, features, tmp_path / "fp32", mixed_precision="no").fit()
    assert again.step == 3 and seen and not any(seen)
