"""A tiny draft head, target and dataset for the training-loop tests (not a real method).

`DummyHead` maps the target's last hidden state at position t to logits for token t+2 (like a
single Medusa head without residual blocks) and implements the DraftHead protocol: `method`,
`feature_layers()`, `loss(batch, features) -> LossOutput`, `save_pretrained(path)`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from data.dataset import collate
from heads.base import LossOutput, masked_shift
from heads.target import Target

HIDDEN, VOCAB, SHIFT = 32, 128, 2


class DummyHead(nn.Module):
    """logits_t = W dropout(h_t) predicts token t+2; stats: loss and head0/top1 as [sum, count]."""

    method = "dummy"

    def __init__(self, hidden: int = HIDDEN, vocab: int = VOCAB, dropout: float = 0.0, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.proj = nn.Linear(hidden, vocab)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(vocab, hidden, generator=gen) * 0.02)
            self.proj.bias.zero_()
        self.dropout = nn.Dropout(dropout)

    def feature_layers(self) -> list[int] | None:
        return None

    def loss(self, batch: dict[str, Tensor], features: dict[str, Tensor]) -> LossOutput:
        hidden = features["hidden"].to(self.proj.weight.dtype)  # (B, T, H)
        logits = self.proj(self.dropout(hidden))  # (B, T, V)
        labels = torch.roll(batch["input_ids"], -SHIFT, dims=1)  # labels[:, t] = ids[:, t + 2]
        valid = masked_shift(batch["loss_mask"], SHIFT).bool()  # (B, T)
        per_token = F.cross_entropy(logits[valid].float(), labels[valid], reduction="none")
        count = per_token.new_tensor(float(valid.sum()))
        correct = (logits[valid].argmax(-1) == labels[valid]).sum().float()
        loss = per_token.sum() / count.clamp(min=1)
        stats = {
            "loss": torch.stack([per_token.sum().detach(), count]),
            "head0/top1": torch.stack([correct, count]),
        }
        return LossOutput(loss=loss, stats=stats)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({"method": self.method}) + "\n")
        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(path / "model.safetensors"))


def make_target(seed: int = 0) -> Target:
    """A random 2-layer Llama (hidden 32, vocab 128) wrapped as a frozen Target."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return Target.from_model(LlamaForCausalLM(cfg), name_or_path="tiny-llama-32")


def make_examples(
    n: int, seed: int = 0, min_len: int = 6, max_len: int = 12, prompt_len: int = 2
) -> list[dict]:
    """n random examples with ids: input_ids, loss_mask (0 on the first `prompt_len` tokens)."""
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        ids = torch.randint(4, VOCAB, (length,), generator=gen)
        mask = torch.ones(length, dtype=torch.long)
        mask[:prompt_len] = 0
        examples.append({"input_ids": ids, "loss_mask": mask, "example_id": i})
    return examples


def collate_with_ids(examples: list[dict]) -> dict[str, Tensor]:
    """data.collate plus an `example_id` tensor (B,) so tests can see what each batch held."""
    batch = collate(examples)
    batch["example_id"] = torch.tensor([e["example_id"] for e in examples])
    return batch


def label_count(examples: list[dict]) -> int:
    """How many (position, label) pairs DummyHead scores over these examples."""
    return sum(int(masked_shift(e["loss_mask"][None], SHIFT).sum()) for e in examples)
