"""A recipe variant: a base experiment plus the Hydra overrides that make it a candidate.

    {baseline: [], muon: [trainer.optimizer=muon]}                 # inline, or a .yaml/.json file
    {experiment: eagle3_llama, overrides: [common], variants: {name: entry}}

An entry is a list of train.py overrides, null (the base as is), or a mapping
`{overrides, eval_overrides, experiment, seeds}` (eval_overrides go to evaluate.py; seeds
replace the search's seeds for this variant).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from data.errors import ConfigError

# set by the search itself; a variant may not change them
RESERVED = {
    "trainer.max_steps", "trainer.num_epochs", "trainer.time_budget_min", "seed", "trainer.seed",
    "hydra.run.dir", "data.sources", "data.val_sources", "data.self_distill.enabled",
}  # fmt: skip
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
EXPERIMENTS = Path(__file__).resolve().parents[2] / "conf" / "experiment"


def experiment_settings(name: str, folder: Path | None = None) -> str:
    """An experiment file's settings as parsed (comments and layout do not count), as text; ""
    when there is no such file. Part of a variant's digest: a variant named for its overrides
    trains something else once its base experiment changes (a new default lr, say)."""
    import yaml

    path = (folder or EXPERIMENTS) / f"{name}.yaml"
    if not path.is_file():
        return ""
    return json.dumps(yaml.safe_load(path.read_text()), sort_keys=True, default=str)


@dataclass(frozen=True)
class Variant:
    """A base experiment plus Hydra overrides of train.py (and of evaluate.py: eval_overrides);
    `seeds` replaces the search's seeds for this variant."""

    name: str
    experiment: str
    overrides: tuple[str, ...] = ()
    eval_overrides: tuple[str, ...] = ()
    seeds: tuple[int, ...] | None = None

    @property
    def digest(self) -> str:
        """What the variant trains, hashed: a changed variant, or one whose base experiment
        changed, must not reuse old points."""
        base = experiment_settings(self.experiment)
        text = json.dumps([self.experiment, list(self.overrides), base])
        return hashlib.sha1(text.encode()).hexdigest()[:10]


def parse_variants(spec: str | Path, experiment: str = "eagle3_llama") -> dict[str, Variant]:
    """Variants, by name, from a JSON/YAML file or inline text (forms: the module doc)."""
    import yaml

    path, text = Path(spec), str(spec)
    if path.suffix in (".json", ".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"--variants {spec}: no such file.")
        text = path.read_text()
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        msg = f"--variants: not JSON/YAML ({e}); give a file or '{{name: [..]}}'."
        raise ConfigError(msg) from None
    if isinstance(doc, dict) and "variants" in doc:
        experiment = doc.get("experiment", experiment)
        common, entries = list(doc.get("overrides") or []), doc["variants"]
    else:
        common, entries = [], doc
    if not isinstance(entries, dict) or not entries:
        raise ConfigError("--variants: give a mapping of variant name -> list of overrides.")
    return {name: _variant(str(name), entry, experiment, common) for name, entry in entries.items()}


def _variant(name: str, entry, experiment: str, common: list[str]) -> Variant:
    if not _NAME.match(name):
        raise ConfigError(f"variant {name!r}: use letters, digits and _ . + - in its name.")
    if entry is None or isinstance(entry, list):
        entry = {"overrides": entry or []}
    if not isinstance(entry, dict) or set(entry) - {"overrides", "eval_overrides", "experiment",
                                                    "seeds"}:  # fmt: skip
        raise ConfigError(f"variant {name}: give a list of overrides or {{overrides: [..], "
                          "eval_overrides: [..], experiment: E, seeds: [..]}}.")  # fmt: skip
    overrides = [*common, *(entry.get("overrides") or [])]
    for o in overrides:
        key = str(o).split("=", 1)[0].lstrip("+~")
        if "=" not in str(o):
            raise ConfigError(f"variant {name}: {o!r} is not a Hydra override (key=value).")
        if key in RESERVED:
            raise ConfigError(f"variant {name}: {key} is set by the search; drop {o!r}.")
    seeds = entry.get("seeds")
    return Variant(
        name=name,
        experiment=entry.get("experiment", experiment),
        overrides=tuple(map(str, overrides)),
        eval_overrides=tuple(map(str, entry.get("eval_overrides") or [])),
        seeds=tuple(int(s) for s in seeds) if seeds else None,
    )
