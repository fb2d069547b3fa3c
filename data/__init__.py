"""Text -> tokens -> target features: read chat data, apply chat templates, mask assistant
tokens, split, collate, and cache the frozen target's hidden states.

This package imports nothing from heads/, train/ or eval/ (the target is duck-typed)."""

from data.chat import (
    CHATML_TEMPLATE,
    ChatEncoder,
    ChatTemplateError,
    resolve_chat_template,
    tokenize_conversation,
)
from data.config import DataConfig, SelfDistillSettings
from data.dataset import (
    DataSource,
    ExampleDataset,
    build_examples,
    collate,
    corpus_stats,
    load_conversations,
    split_examples,
)
from data.features import FeatureCacheMismatch, compute_features, feature_meta
from data.formats import (
    DataFormatError,
    normalize_row,
    read_conversations,
    read_prompts,
)
from data.prepare import PreparedData, prepare_data

__all__ = [
    "CHATML_TEMPLATE",
    "ChatEncoder",
    "ChatTemplateError",
    "DataConfig",
    "DataFormatError",
    "DataSource",
    "ExampleDataset",
    "FeatureCacheMismatch",
    "PreparedData",
    "SelfDistillSettings",
    "build_examples",
    "collate",
    "compute_features",
    "corpus_stats",
    "feature_meta",
    "load_conversations",
    "normalize_row",
    "prepare_data",
    "read_conversations",
    "read_prompts",
    "resolve_chat_template",
    "split_examples",
    "tokenize_conversation",
]
