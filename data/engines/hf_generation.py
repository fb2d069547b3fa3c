"""Self-distillation's HF backend: batched `generate` on the target in this process.

The counterpart of data/engines/server_generation.py's ServerGenerator, behind the same
`generate(prompts, seed)`: (answer ids without EOS, "eos" | "length") per prompt, so
data/distill.py keeps one set of resume, sharding and refusal rules for every backend.
"""

from __future__ import annotations

import torch


class HFGenerator:
    """Batched `generate` with left padding, one turn of several conversations at a time."""

    def __init__(self, target, cfg, encoder, eos_ids: list[int]):
        """cfg: the distillation settings (data.distill.DistillConfig: dtype, batch_size and the
        answers' temperature, top_p, max_new_tokens); encoder: data.chat.ChatEncoder."""
        from transformers import GenerationConfig

        from data.generation import NEUTRAL_PROCESSORS

        self.model, self.tok = generation_model(target.model, cfg.dtype), target.tokenizer
        self.cfg, self.encoder = cfg, encoder
        self.eos = set(eos_ids)
        pad = self.tok.pad_token_id
        self.pad = pad if pad is not None else eos_ids[0]
        self._config = lambda temperature, top_p, max_new_tokens, top_k=0: GenerationConfig(
            max_new_tokens=max_new_tokens,
            min_length=0,
            num_beams=1,
            **(
                NEUTRAL_PROCESSORS
                | (
                    {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}
                    if temperature > 0
                    else {"do_sample": False}
                )
            ),
            eos_token_id=eos_ids,
            pad_token_id=self.pad,
        )
        self.config = self._config(cfg.temperature, cfg.top_p, cfg.max_new_tokens)

    def __enter__(self) -> HFGenerator:  # nothing to start: the model is in this process
        return self

    def __exit__(self, *exc) -> None:
        self.model = None  # frees a cast copy (the target itself stays loaded)

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        seed: int,
        temperature: float | None = None,
        top_p: float | None = None,
        max_new_tokens: int | None = None,
        top_k: int | None = None,
    ) -> list[tuple[list[int], str]]:
        """(answer ids without EOS, "eos" | "length") for each prompt; temperature, top_p,
        max_new_tokens and top_k (0 or None: no cut) override the answer settings (prompt
        synthesis samples user turns).
        Prompts are generated in length-sorted groups of batch_size (little padding)."""
        config = self.config
        if any(v is not None for v in (temperature, top_p, max_new_tokens, top_k)):
            config = self._config(
                self.cfg.temperature if temperature is None else temperature,
                self.cfg.top_p if top_p is None else top_p,
                self.cfg.max_new_tokens if max_new_tokens is None else max_new_tokens,
                top_k or 0,
            )
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        answers: list = [None] * len(prompts)
        size = self.cfg.batch_size
        for g, start in enumerate(range(0, len(order), size)):
            group = order[start : start + size]
            done = self._batch([prompts[i] for i in group], (seed + g) % 2**31, config)
            for i, answer in zip(group, done):
                answers[i] = answer
        return answers

    def _batch(self, prompts: list[list[int]], seed: int, config) -> list[tuple[list[int], str]]:
        width = max(map(len, prompts))
        device = self.model.device
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row ends where generation starts
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        torch.manual_seed(seed)
        out = self.model.generate(
            ids.to(device), attention_mask=mask.to(device), generation_config=config
        )
        answers = []
        for row in out[:, width:].tolist():
            cut = next((j for j, t in enumerate(row) if t in self.eos), None)
            answers.append((row, "length") if cut is None else (row[:cut], "eos"))
        return answers


def generation_model(model, dtype: str | None):
    """The model `generate` runs on: the target itself, or a copy cast to `dtype` (the target
    keeps its weights; features and training read it unchanged)."""
    if dtype is None or getattr(torch, dtype) == model.dtype:
        return model
    import copy

    return copy.deepcopy(model).to(getattr(torch, dtype)).eval()


__all__ = ["HFGenerator", "generation_model"]
