"""The settings of an EAGLE-3 draft head (heads/eagle3.py), validated when built: what a run's
`head:` section holds for `method: eagle3`. Every field has a default, so heads saved before a
field existed load unchanged."""

from __future__ import annotations

from dataclasses import dataclass

from heads.acceptance import check_horizon

NOISE_TYPES = ("uniform", "gaussian")


@dataclass
class Eagle3Config:
    # HF hidden_states indices fused by fc (null: [2, N//2, N-3] for an N-layer target).
    aux_layers: list[int] | None = None
    draft_vocab_size: int | None = 32000  # null or >= the target vocab: the full vocabulary
    ttt_steps: int = 7  # unrolled training-time-test steps
    decay: float = 0.8  # step i's loss weight is decay**i
    mask_outside_vocab: bool = True  # skip positions whose target argmax is outside the draft vocab
    topk: int = 5
    # EAGLE-3.1: an RMSNorm of its own on each fused target layer before fc (speculators' and
    # vLLM's `fc_norm`, tensors fc_norm.{i}.weight)
    fc_norm: bool = False
    # EAGLE-3.1: feed the post-norm state, not the layer's residual output, to the next step
    # (training-time test and drafting; speculators' and vLLM's `norm_output`)
    norm_output: bool = False
    # Noise on the target features fc reads, while training only: uniform U(-a/2, a/2) (EAGLE-1's
    # convention, a = 0.2 there; speculators' noise_std s is U(-s, s), a = 2s) or gaussian
    # N(0, a^2), a = feature_noise. 0 disables.
    feature_noise: float = 0.0
    feature_noise_type: str = "uniform"
    # Dropout while training on the fused features and on each unrolled step's output state (to
    # lm_head and the next step): for heads that see their data many times. 0 disables.
    dropout: float = 0.0
    # GRIFFIN-style: step i trains only on rows whose steps 0..i-1 all predicted the target's
    # top-1 (the rows a greedy chain would reach); the stats still cover every row
    mask_after_miss: bool = False
    # HASS's top-K distillation: add hass_weight * -sum over the target's top hass_topk tokens
    # of p log q to each step's loss (HASS: K = 10, weight 1); 0 disables
    hass_topk: int = 0
    hass_weight: float = 1.0
    # start the draft layer as a copy of a target layer (heads/eagle3_target.py), not random
    init_from_target: bool = False
    # decoder layers in the draft: the first reads [embeddings; fused features] (2H), the rest
    # are plain pre-norm layers on its residual stream (vLLM's multi-layer llama_eagle3). SGLang,
    # llama.cpp and OpenVINO GenAI serve one layer only.
    num_layers: int = 1
    # validation's chain_tau_est_horizon walks each turn's first N tokens (null: not logged)
    estimate_horizon: int | None = 48

    def __post_init__(self) -> None:
        if self.aux_layers is not None:
            self.aux_layers = [int(i) for i in self.aux_layers]
            if not self.aux_layers:
                raise ValueError("head.aux_layers is empty: give layer indices, or null.")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError("head.draft_vocab_size must be positive, or null for the full vocab.")
        if self.num_layers < 1:
            raise ValueError(f"head.num_layers={self.num_layers}: an EAGLE-3 draft has 1 or more.")
        if self.ttt_steps < 1:
            raise ValueError(f"head.ttt_steps={self.ttt_steps}: unroll at least one step.")
        if not 0 < self.decay <= 1:
            raise ValueError(f"head.decay={self.decay}: use a weight in (0, 1].")
        if self.topk < 1:
            raise ValueError(f"head.topk={self.topk}: use 1 or more.")
        check_horizon(self.estimate_horizon)
        if not self.feature_noise >= 0:
            raise ValueError(f"head.feature_noise={self.feature_noise}: use >= 0 (0 disables).")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"head.dropout={self.dropout}: use a probability in [0, 1), 0 off.")
        if self.hass_topk < 0 or not self.hass_weight >= 0:
            raise ValueError(
                f"head.hass_topk={self.hass_topk}, head.hass_weight={self.hass_weight}: use 0 or "
                "more for both (hass_topk=0 disables the term)."
            )
        if self.feature_noise_type not in NOISE_TYPES:
            raise ValueError(
                f"head.feature_noise_type={self.feature_noise_type!r}: use one of "
                f"{', '.join(NOISE_TYPES)}."
            )
