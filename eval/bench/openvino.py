"""OpenVINO GenAI methods for the benchmark: the same requests, in the same run, on CPU.

- `openvino_plain`: the target's IR in GenAI's CPU pipeline (continuous batching, paged
  attention), no drafting: the baseline `openvino_draft` is sped up against;
- `openvino_draft`: the same target with the run's EAGLE-3 head as GenAI's EAGLE-3 draft, as a
  chain (`num_assistant_tokens`) or an EAGLE-2 tree (`branching_factor` children per node and
  nodes per level, `tree_depth` levels, the best `num_assistant_tokens` nodes verified).

Both export what they need once (heads/interop/openvino.py): the target into the model cache
(`<model.cache_dir>/openvino/`), the draft into the run dir. Each method keeps one pipeline for
the whole run and feeds the harness's token ids, so every method decodes the same prompt.

Accept lengths: GenAI streams the tokens of each target step in one `write` call of a token
streamer (the prefill's token first, then the accepted draft tokens plus the bonus token of each
verify step, cut at max_new_tokens), so the streamer's call sizes are the per-step accept
lengths in order; tau means what it means for the HF methods.

Tree settings: `openvino.tree` takes what `tree` takes, limited to what GenAI drafts: a chain
(an int, or single-child paths) or an EAGLE-2 dynamic tree {depth, top_k, total_tokens}, which is
GenAI's (tree_depth, branching_factor, num_assistant_tokens = total_tokens - 1); null means the
run's own `tree`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from data.errors import ConfigError
from eval.bench.methods import Record
from eval.engine.method_names import typed_name
from eval.engine.tree_spec import TreeSpec, resolve_tree

OPENVINO_METHODS = ("openvino_plain", "openvino_draft")
# allowed values of each precision setting (OpenVINO element type names)
PRECISIONS = {
    "kv_cache_precision": ("f32", "f16", "bf16", "u8"),
    "inference_precision": ("f32", "f16", "bf16"),
}


@dataclass
class OpenVinoSettings:
    """bench's `openvino` block: the exported folders and the pipeline's settings."""

    # null: the run's target, exported once per weight type into the model cache; resolved to a
    # folder, or {weight type: folder} when `weights` is a list
    target_dir: Any = None
    draft_dir: str | None = None  # null: head_path's head, exported into the run dir
    tree: Any = 3  # a chain length, {depth, top_k, total_tokens}, a conf/tree name; null: `tree`
    # the target's IR weights: f32, f16, int8 or int4 (weight-only), or a list of them: every
    # OpenVINO method then runs once per type, named `<method>@<type>`
    weights: Any = "f32"
    draft_weights: str = "f32"  # the draft's IR weights: f32 or f16
    threads: int = 2  # INFERENCE_NUM_THREADS of both models
    # null: the engine's defaults (CPU: a u8 KV cache; bf16 compute on CPUs with AMX/AVX512-BF16);
    # f32 + f32 make a tree verify round exactly like a one-token step
    kv_cache_precision: str | None = "f32"
    inference_precision: str | None = "f32"
    cache_size_gb: int = 1  # KV cache of the paged pipeline in GB (target and draft)

    def __post_init__(self) -> None:
        for name, allowed in PRECISIONS.items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ConfigError(
                    f"openvino.{name}={value!r}: use one of {', '.join(allowed)}, or null."
                )
        from heads.interop.openvino import DRAFT_WEIGHT_TYPES, WEIGHT_TYPES

        types = list(self.weights) if isinstance(self.weights, (list, tuple)) else [self.weights]
        bad = [w for w in types if w not in WEIGHT_TYPES]
        if not types or bad or len(set(types)) != len(types):
            raise ConfigError(
                f"openvino.weights={self.weights!r}: use one of {', '.join(WEIGHT_TYPES)}, or a "
                "list of distinct ones."
            )
        if self.draft_weights not in DRAFT_WEIGHT_TYPES:
            raise ConfigError(
                f"openvino.draft_weights={self.draft_weights!r}: use "
                f"{' or '.join(DRAFT_WEIGHT_TYPES)}."
            )
        if self.threads < 1 or self.cache_size_gb <= 0:
            raise ConfigError("openvino.threads must be >= 1 and openvino.cache_size_gb > 0.")


def genai_draft_config(tree: TreeSpec) -> dict[str, int]:
    """GenerationConfig fields that draft `tree` in GenAI (a chain or an EAGLE-2 tree)."""
    if tree.dynamic is not None:
        d = tree.dynamic
        n = d.total_tokens - 1
        reachable = d.top_k * d.top_k * (d.depth - 1) + d.top_k
        if not d.depth <= n <= reachable:
            raise ConfigError(
                f"tree {{depth: {d.depth}, top_k: {d.top_k}, total_tokens: {d.total_tokens}}}: "
                f"OpenVINO GenAI verifies total_tokens - 1 = {n} nodes, which must lie in "
                f"[depth, top_k^2 * (depth - 1) + top_k] = [{d.depth}, {reachable}]."
            )
        return {"num_assistant_tokens": n, "branching_factor": d.top_k, "tree_depth": d.depth}
    chain = tuple((0,) * d for d in range(1, len(tree.paths) + 1))
    if tree.paths and tree.paths == chain:
        return {"num_assistant_tokens": len(chain)}
    raise ConfigError(
        "openvino.tree: OpenVINO GenAI drafts a chain or an EAGLE-2 dynamic tree, not fixed "
        "paths; set openvino.tree to a chain length (3) or {depth: 4, top_k: 4, total_tokens: 16}."
    )


def _properties(settings: OpenVinoSettings) -> dict:
    import openvino as ov

    props: dict = {"INFERENCE_NUM_THREADS": settings.threads}
    if settings.kv_cache_precision:
        props["KV_CACHE_PRECISION"] = getattr(ov.Type, settings.kv_cache_precision)
    if settings.inference_precision:
        props["INFERENCE_PRECISION_HINT"] = getattr(ov.Type, settings.inference_precision)
    return props


def _step_counter():
    """A GenAI token streamer that records how many tokens each `write` brought."""
    import openvino_genai as og

    class StepCounter(og.StreamerBase):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []

        def write(self, token):
            self.sizes.append(len(token) if isinstance(token, list) else 1)
            return og.StreamingStatus.RUNNING

        def end(self) -> None:
            pass

    return StepCounter()


class OpenVinoMethod:
    """One benchmark method served by one GenAI pipeline (built on first use)."""

    def __init__(
        self,
        name: str,
        target_dir: str | Path,
        settings: OpenVinoSettings,
        eos_ids: list[int],
        draft_dir: str | Path | None = None,
        draft: dict[str, int] | None = None,
        label: str = "",
    ) -> None:
        self.name, self.settings, self.eos_ids = name, settings, list(eos_ids)
        self.target_dir, self.draft_dir, self.draft = target_dir, draft_dir, dict(draft or {})
        if (draft_dir is None) != (draft is None):
            raise ValueError("a drafting OpenVinoMethod needs both draft_dir and draft settings.")
        self.max_draft_depth = self.draft.get("tree_depth") or self.draft.get(
            "num_assistant_tokens", 0
        )
        self.baseline = typed_name("openvino_plain", label) if draft_dir is not None else None
        self.pipe = None

    def _pipeline(self):
        import openvino_genai as og

        if self.pipe is None:
            props = _properties(self.settings)
            scheduler = og.SchedulerConfig()
            scheduler.cache_size = self.settings.cache_size_gb
            extra = {}
            if self.draft_dir is not None:
                extra["draft_model"] = og.draft_model(str(self.draft_dir), "CPU", **props)
            self.pipe = og.LLMPipeline(
                str(self.target_dir), "CPU", scheduler_config=scheduler, **extra, **props
            )
        return self.pipe

    def _config(self, max_new_tokens: int):
        import openvino_genai as og

        config = og.GenerationConfig()
        config.max_new_tokens = max_new_tokens
        config.do_sample = False
        if self.eos_ids:
            config.eos_token_id = self.eos_ids[0]
            config.stop_token_ids = set(self.eos_ids)
        for key, value in self.draft.items():
            setattr(config, key, value)
        return config

    def run(self, input_ids: Tensor, max_new_tokens: int) -> Record:
        import numpy as np
        import openvino as ov

        pipe = self._pipeline()
        ids = ov.Tensor(np.ascontiguousarray(input_ids[:1].cpu().numpy().astype(np.int64)))
        steps = _step_counter()
        t0 = time.perf_counter()
        result = pipe.generate(ids, self._config(max_new_tokens), steps)
        seconds = time.perf_counter() - t0
        tokens = [int(t) for t in result.tokens[0]]
        if sum(steps.sizes) != len(tokens):
            raise RuntimeError(
                f"{self.name}: GenAI streamed {sum(steps.sizes)} tokens but returned "
                f"{len(tokens)}; the per-step accept lengths cannot be read from its streamer."
            )
        lengths = steps.sizes[1:]  # the first write is the prefill's token
        return Record(
            tokens=tokens,
            target_forwards=len(steps.sizes),
            prefill_tokens=min(1, len(tokens)),
            accept_lengths=lengths,
            seconds=seconds,
            draft_seconds=_draft_seconds(result) if self.draft_dir is not None else 0.0,
        )

    def close(self) -> None:
        self.pipe = None


def _draft_seconds(result) -> float:
    """Wall time the draft model's inferences took in one request (GenAI's perf metrics, µs)."""
    metrics = getattr(result, "extended_perf_metrics", None)
    if metrics is None:
        return 0.0
    durations = metrics.draft_model_metrics.raw_metrics.inference_durations
    return sum(float(d) for d in durations) / 1e6


def build_openvino_methods(
    names, settings: OpenVinoSettings, run_tree: TreeSpec | None, eos_ids: list[int]
) -> list[OpenVinoMethod]:
    """The OpenVINO methods among `names`, in that order (settings resolved: folders given); with
    several target folders ({weight type: folder}), each method once per type, `<method>@<type>`."""
    from heads.interop.openvino import require_openvino

    require_openvino(genai=True)
    if not settings.target_dir:
        raise ValueError("OpenVINO methods need openvino.target_dir (resolve it first).")
    targets = settings.target_dir
    if not isinstance(targets, dict):
        targets = {"": targets}
    draft = None
    if "openvino_draft" in names:
        if not settings.draft_dir:
            raise ValueError("openvino_draft needs openvino.draft_dir (or head_path).")
        tree = resolve_tree(settings.tree) if settings.tree is not None else run_tree
        if tree is None:
            raise ConfigError("openvino.tree is null and the run has no tree.")
        draft = genai_draft_config(tree)
    out = []
    for label, folder in targets.items():
        for name in names:
            typed = typed_name(name, label)
            if name == "openvino_plain":
                out.append(OpenVinoMethod(typed, folder, settings, eos_ids, label=label))
            elif name == "openvino_draft":
                out.append(
                    OpenVinoMethod(
                        typed, folder, settings, eos_ids, settings.draft_dir, draft, label
                    )
                )
    return out


def openvino_settings(cfg, head, target, out_dir: Path) -> OpenVinoSettings:
    """evaluate.py's `openvino` block resolved: the target folder (exported once, cached by its
    weights) and the draft folder (head_path's head exported into the run dir)."""
    from omegaconf import OmegaConf

    from data.paths import cache_root
    from heads.interop.openvino import export_openvino_draft, openvino_target_dir

    doc = OmegaConf.to_container(cfg.openvino, resolve=True)
    settings = OpenVinoSettings(**doc)
    if settings.target_dir is None:
        cache = cfg.model.get("cache_dir") or cache_root()
        if isinstance(settings.weights, (list, tuple)):
            settings.weights = [str(w) for w in settings.weights]
            settings.target_dir = {
                w: str(openvino_target_dir(target, cache, w)) for w in settings.weights
            }
        else:
            settings.target_dir = str(openvino_target_dir(target, cache, settings.weights))
    if settings.draft_dir is None and "openvino_draft" in cfg.methods:
        if head is None:
            raise ConfigError("openvino_draft needs head_path (or openvino.draft_dir).")
        folder = Path(out_dir) / "openvino-draft"
        draft = export_openvino_draft(head, target, folder, settings.draft_weights)
        settings.draft_dir = str(draft)
    return settings
