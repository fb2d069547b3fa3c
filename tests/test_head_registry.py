"""The head contract lives in heads/: the Protocols in heads/base.py, the per-method facts on the
head classes, one registry (heads.HEAD_TYPES). Outside heads/, nothing dispatches on a method's
name: a new method that drafts like an existing one needs no change there."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest
import torch

import heads
from eval.engine.drafting import make_proposer
from eval.engine.proposers import MedusaProposer
from eval.engine.tree_spec import resolve_tree
from eval.publish.model_card import render_model_card
from heads import interop
from heads.base import BlockDrafter, DraftHead, FeatureDrafter, ParallelDrafter
from heads.eagle import EagleConfig, EagleHead
from heads.medusa import MedusaConfig, MedusaHeads
from heads.medusa2 import Medusa2Config, Medusa2Head

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE_HEADS = ["eval", "train", "data", "scripts", "train.py", "evaluate.py"]


def _protocol_members(proto) -> set[str]:
    names = set(getattr(proto, "__annotations__", {}))
    names |= {n for n, v in vars(proto).items() if not n.startswith("_") and callable(v)}
    names |= {n for n, v in vars(proto).items() if isinstance(v, (property, classmethod))}
    return names


def _head_modules():
    for path in sorted((ROOT / "heads").glob("*.py")):
        yield importlib.import_module(f"heads.{path.stem}")


def test_every_head_class_in_heads_is_registered_once():
    found = {
        obj
        for module in _head_modules()
        for _, obj in inspect.getmembers(module, inspect.isclass)
        if obj.__module__ == module.__name__ and hasattr(obj, "config_class")
    }
    assert found == set(heads.HEAD_TYPES)
    assert len({cls.method for cls in heads.HEAD_TYPES}) == len(heads.HEAD_TYPES)
    assert len({cls.config_class for cls in heads.HEAD_TYPES}) == len(heads.HEAD_TYPES)


@pytest.mark.parametrize("cls", heads.HEAD_TYPES, ids=lambda c: c.method)
def test_each_head_implements_the_whole_contract(cls, tokenizer):
    from conftest import make_llama

    from heads.target import Target

    members = _protocol_members(DraftHead) | _protocol_members(cls.drafting)
    assert "drafting" in members and "init_from" in members and "max_draft_depth" in members
    missing = sorted(
        m for m in members if not hasattr(cls, m) and m not in ("config", "target_info")
    )
    assert not missing, f"{cls.__name__} lacks {missing}"
    assert cls.drafting in (ParallelDrafter, FeatureDrafter, BlockDrafter)
    assert cls.export_formats[0] == "native" and set(cls.export_formats) <= set(interop.FORMATS)
    target = Target.from_model(make_llama(), tokenizer, name_or_path="tiny-llama")
    config = cls.config_class(**({"draft_vocab_size": None} if cls.method == "eagle3" else {}))
    head = heads.build_head(config, target)
    assert type(head) is cls
    assert isinstance(head, DraftHead) and isinstance(head, cls.drafting)


def test_build_head_dispatches_on_the_exact_config_type(tiny_llama):
    assert type(heads.build_head(MedusaConfig(num_heads=2), tiny_llama)) is MedusaHeads
    assert type(heads.build_head(Medusa2Config(num_heads=2), tiny_llama)) is Medusa2Head

    @dataclasses.dataclass
    class TweakedEagle(EagleConfig):  # a subclass no head class declares
        extra: int = 0

    with pytest.raises(TypeError, match="no head class takes a TweakedEagle"):
        heads.build_head(TweakedEagle(), tiny_llama)


def _method_names_used_as_values(path: Path, names: set[str]) -> list[str]:
    """String constants (outside docstrings) that are exactly a registered method name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings
    ]


def test_no_module_outside_heads_names_a_method():
    names = set(heads.HEAD_CLASSES)
    files = []
    for entry in OUTSIDE_HEADS:
        path = ROOT / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    hits = [hit for file in files for hit in _method_names_used_as_values(file, names)]
    assert not hits, "method names used outside heads/ (ask the head class instead):\n" + "\n".join(
        hits
    )


# ---- a new method that drafts like Medusa plugs in with nothing outside heads/ -------------------


@dataclasses.dataclass
class WideMedusaConfig(MedusaConfig):
    pass


class WideMedusa(MedusaHeads):
    """A stand-in for a new method file in heads/: its own name, config and card wording."""

    method = "wide_medusa"
    config_class = WideMedusaConfig
    title = "Wide Medusa heads"
    hub_tag = "wide-medusa"
    export_formats = ("native",)


def test_a_new_method_needs_no_table_outside_heads(tiny_llama, tmp_path):
    head = WideMedusa.for_target(WideMedusaConfig(num_heads=2), tiny_llama)
    proposer = make_proposer(head, resolve_tree([[0], [0, 0]]))
    assert isinstance(proposer, MedusaProposer)
    with torch.no_grad():
        draft = proposer.propose(_state(tiny_llama))
    assert draft.tokens.shape == (3,)
    check = {"prompts": 1, "max_new_tokens": 4, "tree": "2", "tau_export": 1.0, "tau_head": 1.0}
    card = render_model_card(head, tiny_llama, "native", {}, {}, check, None)
    assert "# Wide Medusa heads for tiny-llama" in card and "- wide-medusa" in card
    with pytest.raises(ValueError, match="'wide_medusa' head cannot be exported as 'medusa'"):
        interop.export_draft(head, tiny_llama, "medusa", tmp_path / "m")


def _state(target):
    from eval.engine.proposers import DecodeState

    hidden = torch.zeros(1, target.hidden_size)
    return DecodeState(hidden, torch.tensor([5]), 3)


def test_eagle_heads_draft_dynamic_trees_and_medusa_heads_do_not(tiny_llama):
    eagle = EagleHead.for_target(EagleConfig(), tiny_llama)
    assert make_proposer(eagle, resolve_tree("dynamic")).tree.depth == 6
    medusa = MedusaHeads.for_target(MedusaConfig(num_heads=2), tiny_llama)
    with pytest.raises(ValueError, match="'medusa' head drafts a static tree only"):
        make_proposer(medusa, resolve_tree("dynamic"))
