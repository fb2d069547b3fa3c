"""Text -> tokens -> target features: read chat data, apply chat templates, mask assistant
tokens, split, collate, and cache the frozen target's hidden states.

This package imports nothing from heads/, train/ or eval/ (the target is duck-typed)."""

from data.chat import (
    CHATML_TEMPLATE,
    ChatTemplateError,
    resolve_chat_template,
    tokenize_conversation,
)
from data.dataset import (
    DataSource,
    ExampleDataset,
    build_examples,
    collate,
    corpus_stats,
    load_conversations,
    split_examples,
)
from data.features import (
    FeatureCacheMismatch,
    compute_features,
    feature_meta,
    load_feature_file,
    read_feature_meta,
    save_feature_file,
)
from data.formats import (
    DataFormatError,
    normalize_row,
    read_conversations,
    read_prompts,
)

__all__ = [
    "CHATML_TEMPLATE",
    "ChatTemplateError",
    "DataFormatError",
    "DataSource",
    "ExampleDataset",
    "FeatureCacheMismatch",
    "build_examples",
    "collate",
    "compute_features",
    "corpus_stats",
    "feature_meta",
    "load_conversations",
    "load_feature_file",
    "normalize_row",
    "read_conversations",
    "read_feature_meta",
    "read_prompts",
    "resolve_chat_template",
    "save_feature_file",
    "split_examples",
    "tokenize_conversation",
]
