"""Fitting a static tree to a head's measured per-depth top-k accuracy."""

from __future__ import annotations

import torch

from data.dataset import collate
from eval.engine.tree import build_tree, expected_acceptance_paths
from eval.engine.tree_fit import rank_accuracy
from heads.medusa import MedusaConfig, MedusaHeads


def test_rank_accuracy_agrees_with_training_stats(tiny_llama):
    g = torch.Generator().manual_seed(0)
    examples = []
    for n in (12, 17, 9):
        ids = torch.randint(4, 256, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.long)
        mask[3:] = 1
        examples.append({"input_ids": ids, "loss_mask": mask})
    head = MedusaHeads.for_target(MedusaConfig(num_heads=3), tiny_llama)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    acc = rank_accuracy(head, tiny_llama, examples, max_rank=5, against="data")
    assert len(acc) == 3 and all(len(row) == 5 for row in acc)
    assert all(sum(row) <= 1 + 1e-9 for row in acc)
    batch = collate(examples)
    stats = head.loss(batch, tiny_llama.features(batch["input_ids"], batch["attention_mask"])).stats
    for d in range(3):
        top1 = float(stats[f"head{d}/top1"][0] / stats[f"head{d}/top1"][1])
        top5 = float(stats[f"head{d}/top5"][0] / stats[f"head{d}/top5"][1])
        assert abs(acc[d][0] - top1) < 1e-6
        assert abs(sum(acc[d]) - top5) < 1e-6


def test_fitted_tree_prefers_the_accurate_head():
    accuracy = [[0.9, 0.05, 0.01], [0.1, 0.5, 0.3]]  # head 1's best guess is its rank 1
    paths = expected_acceptance_paths(accuracy, 4)
    assert paths == [[0], [0, 1], [0, 2]]
    tree = build_tree(paths)
    assert tree.num_nodes == 4


def test_rank_accuracy_against_the_target_greedy_tokens(tiny_llama):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(4, 256, (20,), generator=g)
    examples = [{"input_ids": ids, "loss_mask": torch.ones(20, dtype=torch.long)}]
    head = MedusaHeads.for_target(MedusaConfig(num_heads=2), tiny_llama)
    # An untrained head 0 is the target's lm_head applied to h_t, so at rank 0 it agrees with the
    # target's greedy token for t+2 exactly where argmax lm_head(h_t) == argmax lm_head(h_{t+1}).
    acc = rank_accuracy(head, tiny_llama, examples, max_rank=3, against="target")
    greedy = tiny_llama.lm_head(
        tiny_llama.features(ids[None], torch.ones(1, 20).long())["hidden"][0]
    )
    greedy = greedy.argmax(-1)
    want = (greedy[:-2] == greedy[1:-1]).float().mean().item()
    assert abs(acc[0][0] - want) < 1e-6
