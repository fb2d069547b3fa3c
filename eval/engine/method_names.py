"""How a benchmark names a method run against one of several target types: `llama_cpp_draft@q4_0`
is `llama_cpp_draft` on the Q4_0 entry of `llama_cpp.target_gguf`. The benchmark writes these
names (eval/bench/llama_cpp_targets.py) and the results table reads them (lab/results_table.py,
outside the package); the spelling lives in the engine, which both can import."""

from __future__ import annotations

SEP = "@"


def typed_name(name: str, label: str) -> str:
    """`llama_cpp_draft` of target entry `label` (no label: one target, the plain name)."""
    return f"{name}{SEP}{label}" if label else name


def split_name(name: str) -> tuple[str, str]:
    """`llama_cpp_draft@q4_0` -> (`llama_cpp_draft`, `q4_0`); a plain name -> (name, "")."""
    base, _, label = name.partition(SEP)
    return base, label
