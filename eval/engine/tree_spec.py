"""The draft tree a config chooses: the one front door for tree specs.

A config names a tree in many ways: a conf/tree option (`tree16`, `dynamic`), a yaml file, a
`{paths: [...]}` or `{depth, top_k, total_tokens}` mapping, a list of Medusa-style paths, or an
int d (a chain of d top-1 tokens). `resolve_tree` turns any of them into a `TreeSpec` once, where
the choice enters (evaluate.py's `tree` and `heads:` entries, TauEvaluator, the GGUF export's
chain); past that, code takes the TreeSpec (make_proposer, head_method and build_methods accept
nothing else) and never parses again.

A TreeSpec is either static (paths, built once into TreeBuffers by eval/engine/tree.py) or dynamic
(EAGLE-2's DynamicTreeConfig; eval/engine/dynamic_tree.py grows such a tree at every step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from eval.engine.dynamic_tree import DynamicTreeConfig
from eval.engine.tree import TreeBuffers, build_tree, chain_paths

DYNAMIC_KEYS = ("depth", "top_k", "total_tokens")


@dataclass(frozen=True)
class TreeSpec:
    """A static tree (`paths`: Medusa-style rank paths; none = the root alone) or an EAGLE-2
    dynamic tree (`dynamic`). Static paths are checked when the spec is made."""

    paths: tuple[tuple[int, ...], ...] = ()
    dynamic: DynamicTreeConfig | None = None

    def __post_init__(self) -> None:
        if self.dynamic is not None and self.paths:
            raise ValueError("a tree is static (paths) or dynamic (depth/top_k/...), not both.")
        if self.dynamic is None:
            _ = self.buffers  # builds and checks the paths now, at the edge

    @cached_property
    def buffers(self) -> TreeBuffers:
        """The static tree's TreeBuffers (built once; shared, never modified)."""
        if self.dynamic is not None:
            raise ValueError("a dynamic tree has no fixed buffers: it is grown at every step.")
        return build_tree([list(p) for p in self.paths])

    @property
    def depth(self) -> int:
        """Deepest draft token the tree can hold."""
        if self.dynamic is not None:
            return self.dynamic.depth
        return max(map(len, self.paths), default=0)

    @property
    def num_nodes(self) -> int:
        """Nodes verified per step (at most, for a dynamic tree), the root included."""
        if self.dynamic is not None:
            return self.dynamic.total_tokens
        return len(self.paths) + 1

    @classmethod
    def static(cls, paths: Sequence[Sequence[int]]) -> TreeSpec:
        return cls(paths=tuple(tuple(p) for p in paths))


def resolve_tree(tree) -> TreeSpec:
    """Any way a config names a tree (see the module doc), or a TreeSpec (returned as is)."""
    if isinstance(tree, TreeSpec):
        return tree
    if isinstance(tree, DynamicTreeConfig):
        return TreeSpec(dynamic=tree)
    if isinstance(tree, bool):
        raise ValueError(f"tree={tree!r}: give a conf/tree name, a yaml path, paths or an int.")
    if isinstance(tree, int):
        return TreeSpec.static(chain_paths(tree))
    if isinstance(tree, (str, Path)):
        return load_tree_spec(_tree_file(str(tree)))
    if isinstance(tree, Mapping):
        return _from_mapping(tree, "tree config")
    if isinstance(tree, Sequence):
        return TreeSpec.static(tree)
    raise ValueError(f"tree={tree!r}: give a conf/tree name, a yaml path, paths or an int.")


def load_tree_spec(path: str | Path) -> TreeSpec:
    """Read a conf/tree/*.yaml file: `paths: [...]` or `depth/top_k/total_tokens`."""
    import yaml

    doc = yaml.safe_load(Path(path).read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping (`paths`, or depth/top_k/total_tokens).")
    return _from_mapping(doc, str(path))


def _from_mapping(doc: Mapping, where: str) -> TreeSpec:
    doc = dict(doc)
    if "paths" in doc and len(doc) == 1:
        return TreeSpec.static(doc["paths"])
    if not doc or not doc.keys() <= set(DYNAMIC_KEYS):
        raise ValueError(
            f"{where}: keys {sorted(doc)}; give `paths` (a static tree) or any of "
            f"{list(DYNAMIC_KEYS)} (an EAGLE-2 dynamic tree)."
        )
    return TreeSpec(dynamic=DynamicTreeConfig(**{k: int(v) for k, v in doc.items()}))


def _tree_file(name: str) -> Path:
    """The yaml file a tree name means: conf/tree/NAME.yaml, or a path."""
    from data.paths import resolve_path

    if "/" not in name and not name.endswith((".yaml", ".yml")):
        path = resolve_path(f"conf/tree/{name}.yaml")
        if not path.is_file():
            known = sorted(p.stem for p in path.parent.glob("*.yaml"))
            raise ValueError(f"tree={name!r}: no conf/tree/{name}.yaml; known: {known}.")
        return path
    path = resolve_path(name)
    if not path.is_file():
        raise FileNotFoundError(f"tree={name!r}: no such tree file.")
    return path


__all__ = ["TreeSpec", "load_tree_spec", "resolve_tree"]
