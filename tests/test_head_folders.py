"""Reading head folders back (heads/folder.py): every damaged, incomplete or mislabelled folder
gives one error naming the file, and a head only loads onto the model it was trained on."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import make_llama, make_tokenizer
from safetensors.torch import load_file, save_file

import heads
from heads import interop
from heads.base import HeadMismatchError
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.folder import HeadFolderError
from heads.medusa import MedusaConfig, MedusaHeads
from heads.target import Target, legacy_fingerprint


def _medusa(target) -> MedusaHeads:
    return MedusaHeads.for_target(MedusaConfig(num_heads=2), target)


@pytest.fixture
def medusa_dir(tiny_llama, tmp_path):
    _medusa(tiny_llama).save_pretrained(tmp_path / "head")
    return tmp_path / "head"


def _edit_config(folder, edit) -> None:
    file = folder / "config.json"
    doc = json.loads(file.read_text())
    edit(doc)
    file.write_text(json.dumps(doc))


def _other_llama(seed: int = 1) -> Target:
    """Same sizes as conftest's tiny_llama, other weights: another model."""
    return Target.from_model(make_llama(seed=seed), make_tokenizer(), name_or_path="other-llama")


# ---- damaged and incomplete files ---------------------------------------------------------------


def test_a_truncated_weights_file_names_the_file(tiny_llama, medusa_dir):
    file = medusa_dir / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(HeadFolderError, match=f"{file}: unreadable safetensors.*again"):
        heads.from_pretrained(medusa_dir, tiny_llama)


def test_a_half_written_config_names_the_file(tiny_llama, medusa_dir):
    file = medusa_dir / "config.json"
    file.write_text(file.read_text()[:40])
    with pytest.raises(HeadFolderError, match=f"{file}: not valid JSON.*cut short"):
        heads.from_pretrained(medusa_dir, tiny_llama)


def test_a_config_without_its_target_record(tiny_llama, medusa_dir):
    _edit_config(medusa_dir, lambda doc: doc.pop("target"))
    with pytest.raises(HeadFolderError, match="config.json: no 'target' mapping"):
        heads.from_pretrained(medusa_dir, tiny_llama)


def test_a_method_that_is_not_a_name(tiny_llama, medusa_dir):
    _edit_config(medusa_dir, lambda doc: doc.update(method=["medusa"]))
    with pytest.raises(HeadFolderError, match=r"config.json: 'method' is \['medusa'\]"):
        heads.from_pretrained(medusa_dir, tiny_llama)


def test_an_unknown_method_lists_the_known_ones(tiny_llama, medusa_dir):
    _edit_config(medusa_dir, lambda doc: doc.update(method="hydra"))
    with pytest.raises(HeadFolderError, match="config.json: unknown head method 'hydra'.*eagle3"):
        heads.from_pretrained(medusa_dir, tiny_llama)


def test_a_medusa_folder_labelled_eagle(tiny_llama, medusa_dir):
    _edit_config(medusa_dir, lambda doc: doc.update(method="eagle"))
    with pytest.raises(HeadFolderError, match="'config' has .*EagleConfig .*'method' does not"):
        heads.from_pretrained(medusa_dir, tiny_llama)
    _edit_config(medusa_dir, lambda doc: doc.update(config={}))  # settings that fit, weights not
    with pytest.raises(HeadFolderError, match="model.safetensors: its tensors do not fit"):
        heads.from_pretrained(medusa_dir, tiny_llama)


def test_a_medusa_folder_labelled_eagle3_lacks_its_vocabulary_map(tiny_llama, medusa_dir):
    _edit_config(medusa_dir, lambda doc: doc.update(method="eagle3", config={}))
    tensors = load_file(medusa_dir / "model.safetensors")
    del tensors["d2t"]
    save_file(tensors, str(medusa_dir / "model.safetensors"))
    with pytest.raises(HeadFolderError, match="model.safetensors: no 'd2t' tensor"):
        heads.from_pretrained(medusa_dir, tiny_llama)


def test_a_folder_that_lost_its_method_is_not_taken_for_an_engine_export(tiny_llama, medusa_dir):
    _edit_config(medusa_dir, lambda doc: doc.pop("method"))
    with pytest.raises(HeadFolderError, match="no 'method' key, though draftsmith wrote") as err:
        heads.from_pretrained(medusa_dir, tiny_llama)
    assert "fc.weight" not in str(err.value)


def test_a_config_with_no_records_at_all(tiny_llama, medusa_dir):
    (medusa_dir / "config.json").write_text("{}")
    with pytest.raises(HeadFolderError, match="config.json: neither draftsmith's records") as err:
        heads.from_pretrained(medusa_dir, tiny_llama)
    assert "fc.weight" not in str(err.value)


def test_a_truncated_engine_export_names_the_file(tiny_llama, tmp_path):
    interop.export_draft(_medusa(tiny_llama), tiny_llama, "medusa", tmp_path / "m")
    file = tmp_path / "m" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(HeadFolderError, match=f"{file}: unreadable safetensors"):
        heads.from_pretrained(tmp_path / "m", tiny_llama)


# ---- the target a head was trained on ------------------------------------------------------------


def test_a_head_refuses_another_model_of_the_same_size(tiny_llama, medusa_dir):
    other = _other_llama()
    assert (other.hidden_size, other.vocab_size) == (tiny_llama.hidden_size, tiny_llama.vocab_size)
    with pytest.raises(HeadMismatchError, match="trained on 'tiny-llama'.*allow_other_target=True"):
        heads.from_pretrained(medusa_dir, other)
    moved = heads.from_pretrained(medusa_dir, other, allow_other_target=True)
    assert moved.target_info.fingerprint == other.fingerprint  # it records where it now sits
    assert moved.target_info.name_or_path == "other-llama"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_head_loads_onto_its_model_in_another_dtype(tiny_llama, medusa_dir, dtype):
    cast = Target.from_model(copy.deepcopy(tiny_llama.model).to(dtype), name_or_path="tiny-llama")
    assert cast.fingerprint == tiny_llama.fingerprint
    loaded = heads.from_pretrained(medusa_dir, cast)
    assert loaded.target_info.fingerprint == tiny_llama.fingerprint


def test_a_head_saved_with_the_earlier_fingerprint_still_loads(tiny_llama, medusa_dir):
    old = legacy_fingerprint(tiny_llama.model)
    assert old != tiny_llama.fingerprint
    _edit_config(medusa_dir, lambda doc: doc["target"].update(fingerprint=old))
    upgraded = heads.from_pretrained(medusa_dir, tiny_llama).target_info  # the same model
    assert upgraded.fingerprint == tiny_llama.fingerprint
    with pytest.raises(HeadMismatchError, match="fingerprint"):
        heads.from_pretrained(medusa_dir, _other_llama())


def test_an_engine_export_refuses_another_model_of_the_same_size(tiny_llama, tmp_path):
    counts = torch.arange(tiny_llama.vocab_size).float()
    head = Eagle3Head.for_target(Eagle3Config(draft_vocab_size=64), tiny_llama, counts)
    interop.export_draft(head, tiny_llama, "eagle3", tmp_path / "e3")
    other = _other_llama()
    with pytest.raises(HeadMismatchError, match="e3 was trained on 'tiny-llama'"):
        heads.from_pretrained(tmp_path / "e3", other)
    assert isinstance(
        heads.from_pretrained(tmp_path / "e3", other, allow_other_target=True), Eagle3Head
    )


@pytest.mark.integration
def test_evaluate_config_knob_allows_a_deliberate_transfer(tmp_path):
    """conf/evaluate.yaml `allow_other_target`: off, a head from another model is refused."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from test_bench import CONF, write_prompts

    from eval.bench.harness import run
    from heads.target import load_target

    prompts = write_prompts(tmp_path / "p.jsonl")
    overrides = ["model=tiny_random_llama", "bench=jsonl", f"bench.path={prompts}",
                 "bench.limit=1", "bench.max_new_tokens=4", "tree=chain", "tree.paths=[[0]]",
                 "methods=[plain,head]", "threads=1", f"out_dir={tmp_path / 'out'}"]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("evaluate", overrides=overrides)
        other_model = compose("evaluate", overrides=[*overrides, "+model.seed=1"]).model
    assert cfg.allow_other_target is False
    other = load_target(instantiate(other_model, _convert_="all"))
    _medusa(other).save_pretrained(tmp_path / "head")
    cfg.head_path = str(tmp_path / "head")
    with pytest.raises(HeadMismatchError, match="allow_other_target"):
        run(cfg)
    cfg.allow_other_target = True
    assert run(cfg)["methods"]["head"]["overall"]["greedy_mismatches"] == 0
