"""The data settings of a run: validated dataclasses, built from conf/data/*.yaml by Hydra in the
entry point (`_target_: data.config.DataConfig`). A bad value is refused when the config is
built, before any model or file is loaded, with a message that says what to change."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from data.chat import template_text
from data.dataset import DataSource
from data.engines.vllm import VLLM_ENGINE
from data.errors import ConfigError
from data.features import AUTOCAST_DTYPES
from data.paths import cache_root

FEATURE_MODES = ("memory", "disk", "online")
# SelfDistillSettings fields that pick the generation engine, not the data asked for
_ENGINE_FIELDS = ("backend", "gguf", "server_url", "server_model", "parallel", "threads")
FEATURE_DTYPES = ("float16", "bfloat16", "float32", "int8")


@dataclass
class SelfDistillSettings:
    """`data.self_distill`: train on the target's own answers to `prompts` instead of
    `data.sources` (data/distill.py; the fields are those of DistillConfig).

    out: the conversations JSONL; null picks one file per target and settings under
    `${DRAFTSMITH_CACHE:-~/.cache/draftsmith}/distill/`, so a later run with the same target and
    settings reuses it and a killed one continues it.
    """

    enabled: bool = False
    prompts: list = field(default_factory=list)
    max_rows: int | None = None
    max_new_tokens: int = 256
    batch_size: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    num_samples: int = 1
    max_prompt_tokens: int = 1536
    seed: int = 0
    out: str | None = None
    # the generation engine (see DistillConfig): hf | llama_cpp | vllm | openai, and its settings
    backend: str = "hf"
    gguf: str | None = None
    server_url: str | None = None
    server_model: str | None = None
    parallel: int = 8
    threads: int = 2
    dtype: str | None = None  # hf's / vllm's generation dtype (null: the target's own)

    def __post_init__(self) -> None:
        self.prompts = [p if isinstance(p, str) else dict(p) for p in self.prompts or []]
        if self.enabled:
            self.distill_config(self.out or "(default)")  # DistillConfig validates the rest

    def default_out(self, target_fingerprint: str, template_sha1: str | None = None) -> str:
        """The output file named after the target and every setting but `enabled` / `out`, and
        after the chat template when the run sets its own (`template_sha1`; a tokenizer's own
        template is part of the fingerprinted target)."""
        settings = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("enabled", "out", *_ENGINE_FIELDS)
        }
        if self.dtype is None:  # files written before the setting existed keep their names
            del settings["dtype"]
        if self.backend != "hf":  # files written by HF keep the names they always had
            engine = VLLM_ENGINE if self.backend == "vllm" else self.gguf or self.server_url
            settings |= {"backend": self.backend, "engine": engine}
        if template_sha1:
            settings["chat_template_sha1"] = template_sha1
        digest = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
        return str(cache_root() / "distill" / f"{target_fingerprint[:12]}-{digest}.jsonl")

    def distill_config(self, out: str):
        """The DistillConfig that writes `out`."""
        from data.distill import DistillConfig

        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(DistillConfig)}
        try:
            return DistillConfig(**{**settings, "out": out})
        except ValueError as err:  # its messages name distill.<field>; here it is data.self_...
            raise ConfigError(str(err).replace("distill.", "data.self_distill.", 1)) from None


@dataclass
class DataConfig:
    """What to train on and how to feed it.

    sources: DataSource entries (a bare path is read as `DataSource(path)`); unused while
        self-distillation is on.
    max_length: tokens per conversation; longer ones are cut, and dropped if no answer is left.
    chat_template: "chatml", Jinja text or a template file, for tokenizers without a template.
    val_fraction / split_seed: the held-out share of conversations and the split's seed.
    val_sources: held-out conversations from files of their own (DataSource entries, as
        `sources`): validation is then exactly these, whatever the training data (e.g. to
        compare runs on growing data against one fixed held-out set); val_fraction is not used,
        and a training conversation equal to a held-out one is dropped from training.
    mix_sources: conversations added to the training split as they are (teacher-forced: the
        target's own logits are still the labels), beside self-distilled answers or `sources`;
        never part of validation, so held-out numbers stay comparable. Their features cost only
        the cache's forward pass, not generation (DataSource entries, as `sources`).
    max_train_examples / max_train_tokens / max_val_examples: keep at most that many training
        conversations, training answer (loss) tokens, validation conversations; 0 or null: all.
    features: "memory" (computed on first read, kept), "disk" (a sharded cache folder, reused
        across runs) or "online" (recomputed every batch).
    feature_dtype: float16, bfloat16, float32, or int8 (disk only).
    feature_autocast: null (the target's own dtype) or bfloat16 / float16: extract features
        with the target's forward under torch.autocast in that dtype (bfloat16 runs 2.5x fp32's
        speed on a CPU with AMX, within 1% of fp32's features:
        docs/reports/2026-12-01-throughput/throughput.md); recorded in
        the disk cache, whose folder it names. fast_bfloat16: bfloat16 on a GPU or on a CPU that
        multiplies bf16 in hardware (AMX or AVX512-BF16), null elsewhere (emulated bf16 is slower
        than fp32 there).
    feature_cache: the disk cache's folder (null: one per target, layers, dtype and data).
    train_on_prompts: label every token of a training conversation after its first (user and
        system turns and the chat template's tokens too), not only the answers. The feature
        cache holds the target's state at every position anyway, so these labels cost no data
        time; heads that distil the target's distribution (EAGLE-3, DFlash) learn it there as
        well. Validation keeps answer tokens only, so held-out numbers stay comparable, and the
        draft vocabulary still counts answer tokens only.
    self_distill: see SelfDistillSettings.
    """

    sources: list = field(default_factory=list)
    max_length: int = 1024
    chat_template: str | None = None
    val_fraction: float = 0.05
    split_seed: int = 0
    val_sources: list = field(default_factory=list)
    mix_sources: list = field(default_factory=list)
    max_train_examples: int | None = None
    max_train_tokens: int | None = None
    max_val_examples: int | None = 64
    features: str = "memory"
    feature_dtype: str = "float16"
    feature_autocast: str | None = None
    feature_cache: str | None = None
    train_on_prompts: bool = False
    self_distill: SelfDistillSettings = field(default_factory=SelfDistillSettings)

    def __post_init__(self) -> None:
        self.sources = [_source(s, i) for i, s in enumerate(self.sources or [])]
        self.val_sources = [_source(s, i) for i, s in enumerate(self.val_sources or [])]
        self.mix_sources = [
            _source(s, i, "mix_sources") for i, s in enumerate(self.mix_sources or [])
        ]
        if not isinstance(self.self_distill, SelfDistillSettings):
            self.self_distill = SelfDistillSettings(**(self.self_distill or {}))
        _check(
            bool(self.sources) or self.self_distill.enabled,
            "data.sources is empty: list at least one file (data.sources=[{path: rows.jsonl}]) "
            "or set data.self_distill.enabled=true.",
        )
        _check(
            self.max_length >= 1,
            f"data.max_length={self.max_length}: give the tokens per conversation (e.g. 1024).",
        )
        _check(
            0 <= self.val_fraction < 1,
            f"data.val_fraction={self.val_fraction}: use a share in [0, 1), e.g. 0.05.",
        )
        for name in ("max_train_examples", "max_train_tokens", "max_val_examples"):
            value = getattr(self, name)
            _check(value is None or value >= 0, f"data.{name}={value}: use a count, or null.")
        _check(
            self.features in FEATURE_MODES,
            f"data.features={self.features!r}: use one of {', '.join(FEATURE_MODES)}.",
        )
        _check(
            self.feature_dtype in FEATURE_DTYPES,
            f"data.feature_dtype={self.feature_dtype!r}: use one of {', '.join(FEATURE_DTYPES)}.",
        )
        if self.feature_autocast == "fast_bfloat16":
            from data.hardware import bf16_is_fast  # imports torch: only when asked

            self.feature_autocast = "bfloat16" if bf16_is_fast() else None
        _check(
            self.feature_autocast in (None, *AUTOCAST_DTYPES),
            f"data.feature_autocast={self.feature_autocast!r}: use null, fast_bfloat16 or one of "
            f"{', '.join(AUTOCAST_DTYPES)}.",
        )
        _check(
            self.feature_dtype != "int8" or self.features == "disk",
            "data.feature_dtype=int8 needs data.features=disk (or use bfloat16).",
        )
        if self.chat_template:
            template_text(self.chat_template)  # a missing template file is named now


def _source(entry: Any, index: int, key: str = "sources") -> DataSource:
    if isinstance(entry, DataSource):
        return entry
    if isinstance(entry, str):
        return DataSource(path=entry)
    if isinstance(entry, Mapping) and "_target_" not in entry:
        return DataSource(**entry)
    raise ConfigError(
        f"data.{key}[{index}]={entry!r}: give a path, or a mapping with path and optionally "
        "format, max_rows, skip, weight, split."
    )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
