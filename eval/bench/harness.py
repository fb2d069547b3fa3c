"""The benchmark harness: every decoding method on the same prompts, in one run, timed alike.

A request is one user turn of one question, rendered with the target's chat template. Multi-turn
questions (MT-bench) continue the conversation with the *canonical* answer to the earlier turns,
HF `generate`'s greedy answer, so every method sees token-identical prompts. Each method runs
every request with the same `max_new_tokens` and torch threads; the methods take turns in a
rotating order so that no method is always the first (or last) one to touch the caches.

Methods (eval/bench/methods.py): `plain` (the in-run baseline, same cache code), `hf_generate` and
`hf_prompt_lookup` (Hugging Face `generate`, greedy, without / with prompt lookup) and `head` (the
draft head under test in `SpeculativeGenerator`). Every output is compared with `hf_generate`'s
token for token.

Outputs in the run dir: results.jsonl (one row per question x turn x method), summary.json and
report.md with PNG plots (eval/bench/report.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from data.engines.vllm import vllm_python
from data.errors import ConfigError
from data.paths import resolve_path
from eval.bench.llama_cpp import LLAMA_CPP_METHODS, build_llama_cpp_methods, llama_cpp_settings
from eval.bench.methods import (
    HEAD,
    METHODS,
    HFGenerateMethod,
    Method,
    Record,
    build_methods,
    eos_token_ids,
    head_method,
)
from eval.bench.openvino import OPENVINO_METHODS, build_openvino_methods, openvino_settings
from eval.bench.ties import (  # the near-tie helpers, also imported from here by callers
    FP32_TIE_FLOOR,  # noqa: F401
    match_info,
    near_tie_threshold,
    rounding_step,  # noqa: F401
    top2_gaps,
)
from eval.bench.vllm import VLLM_METHODS, build_vllm_methods, vllm_settings
from eval.engine.tree_spec import resolve_tree
from heads.interop.openvino import require_openvino

log = logging.getLogger(__name__)

REFERENCE = "hf_generate"  # the greedy reference every output is compared with
# served by another engine
ENGINE_METHODS = (*LLAMA_CPP_METHODS, *OPENVINO_METHODS, *VLLM_METHODS)
ALL_METHODS = (*METHODS, *ENGINE_METHODS)  # every name evaluate.py's `methods` takes


@dataclass
class BenchConfig:
    """Which prompts to run. `path`: a prompt JSONL (MT-bench / Spec-Bench / data.read_prompts).

    limit: keep the first N questions (after the category filter); null: all.
    categories: keep only questions of these categories; null: all.
    per_category: keep the first N questions of each category (before `limit`); null: all.
        `bench=spec_bench bench.per_category=5` covers every Spec-Bench category, the first 5
        MT-bench questions of each of its 8 categories included.
    warmup: run the first N questions' first turn through every method, untimed, before timing.
    """

    name: str = "jsonl"
    path: str = "???"
    limit: int | None = None
    categories: list[str] | None = None
    per_category: int | None = None
    max_new_tokens: int = 128
    warmup: int = 1

    def __post_init__(self) -> None:
        if self.path in ("", "???"):
            raise ValueError(
                "bench.path is required: a prompt JSONL file (bench=jsonl bench.path=...)."
            )
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"bench.limit={self.limit}: use a positive count, or null for all.")
        if self.per_category is not None and self.per_category < 1:
            raise ValueError(
                f"bench.per_category={self.per_category}: use a positive count, or null for all."
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"bench.max_new_tokens={self.max_new_tokens}: need at least 1.")
        if self.warmup < 0:
            raise ValueError(f"bench.warmup={self.warmup}: use 0 or more prompts.")


def load_bench_prompts(cfg: BenchConfig) -> list[dict]:
    """The questions of a prompt file, filtered by category, first `limit` kept."""
    from data import read_prompts

    path = resolve_path(cfg.path)
    if not path.is_file():
        raise FileNotFoundError(f"bench.path={cfg.path}: no such prompt file.")
    prompts = read_prompts(str(path))
    if cfg.categories:
        prompts = [p for p in prompts if p["category"] in set(cfg.categories)]
        if not prompts:
            raise ValueError(f"{path}: no question of categories {cfg.categories}.")
    if cfg.per_category:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p["category"]] = seen.get(p["category"], 0) + 1
            if seen[p["category"]] <= cfg.per_category:
                kept.append(p)
        prompts = kept
    return prompts[: cfg.limit] if cfg.limit else prompts


def encode_chat(tokenizer, messages: list[dict], chat_template: str | None = None) -> Tensor:
    """messages -> input ids [1, T] of the chat template with the assistant prompt appended
    (data.chat.ChatEncoder, as training and self-distillation encode them)."""
    from data.chat import ChatEncoder

    ids = ChatEncoder(tokenizer, chat_template).prompt(messages)
    return torch.tensor([ids], dtype=torch.long)


@dataclass
class BenchRun:
    """What run_benchmark needs besides the target and the methods.

    chat_template: a template for tokenizers without one (see data.resolve_chat_template).
    reference: "hf_generate" (every output is compared with HF greedy decoding of the target in
    the harness's dtype, and later turns continue with its answers) or "first_method" (the first
    method's own output stands in: for engines at a scale where the harness is too slow to run
    every request; prove losslessness on a subset with the harness first).
    near_tie_gap: a greedy mismatch whose first differing token has a target top-1/top-2 logit
    gap at or below this is reported as a near tie (a rounding divergence); None: one rounding
    step of the target's dtype at that logit (see near_tie_threshold). meta: extra facts
    recorded in summary.json.
    """

    bench: BenchConfig
    chat_template: str | None = None
    near_tie_gap: float | None = None
    meta: dict = field(default_factory=dict)
    reference: str = REFERENCE

    def __post_init__(self) -> None:
        if self.reference not in (REFERENCE, "first_method"):
            raise ConfigError(
                f"reference={self.reference!r}: use {REFERENCE} (HF greedy decoding, the lossless "
                "oracle) or first_method (the first method's output, for engines at scale)."
            )


def _baseline_info(rec: Record, records: dict, baseline: str | None) -> dict:
    """Engine methods (llama.cpp) also compare with their engine's own plain decoding: a draft
    must not change that engine's output, whatever its kernels do against HF's."""
    if baseline is None or baseline not in records:
        return {}
    return {"baseline": baseline, "baseline_match": rec.tokens == records[baseline].tokens}


def _warmup(methods: Sequence[Method], prompts: list[dict], setup: BenchRun, tokenizer) -> None:
    """Untimed runs first: first-call allocations and kernel choices stay out of the timings."""
    for question in prompts[: setup.bench.warmup]:
        messages = [{"role": "user", "content": question["turns"][0]}]
        ids = encode_chat(tokenizer, messages, setup.chat_template)
        for method in methods:
            method.run(ids, setup.bench.max_new_tokens)


def _question_rows(target, methods, reference, question: dict, setup: BenchRun, start: int):
    """Rows for every turn x method of one question; later turns continue with HF's answers."""
    tok, max_new = target.tokenizer, setup.bench.max_new_tokens
    rows, history = [], []
    for turn, text in enumerate(question["turns"], start=1):
        history.append({"role": "user", "content": text})
        ids = encode_chat(tok, history, setup.chat_template)
        k = (start + turn - 1) % len(methods)  # rotate who goes first
        records = {m.name: m.run(ids, max_new) for m in [*methods[k:], *methods[:k]]}
        if setup.reference != REFERENCE:
            ref = records[methods[0].name]
        else:
            ref = records[REFERENCE] if REFERENCE in records else reference.run(ids, max_new)
        memo: list[list] = []

        def gaps(ids=ids, ref=ref, memo=memo) -> list:
            if not memo:  # one extra target forward, only when some method mismatched
                memo.append(top2_gaps(target.model, ids, ref.tokens))
            return memo[0]

        dtype = next(target.model.parameters()).dtype
        tie = partial(near_tie_threshold, dtype=dtype, fixed=setup.near_tie_gap)
        for method in methods:
            rec = records[method.name]
            row = {"question_id": question["id"], "category": question["category"], "turn": turn}
            row |= {"method": method.name, "prompt_tokens": ids.shape[1]}
            row |= {"new_tokens": len(rec.tokens), **asdict(rec)}
            row |= _baseline_info(rec, records, getattr(method, "baseline", None))
            rows.append(row | match_info(rec, ref, gaps, tie))
        answer = tok.decode(ref.tokens, skip_special_tokens=True)
        history.append({"role": "assistant", "content": answer})
    return rows


def run_benchmark(
    target, methods: Sequence[Method], bench: BenchConfig | BenchRun, out_dir: str | Path
) -> dict:
    """Run every method on every request of the bench; write results.jsonl, summary.json and
    report.md (+ PNGs) into out_dir. Returns the summary."""
    from eval.bench import report

    setup = bench if isinstance(bench, BenchRun) else BenchRun(bench)
    methods = list(methods)
    if not methods:
        raise ValueError("no methods to benchmark.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_bench_prompts(setup.bench)
    eos, pad = eos_token_ids(target), getattr(target.tokenizer, "pad_token_id", None)
    reference = HFGenerateMethod(REFERENCE, target.model, eos, pad)
    _warmup(methods, prompts, setup, target.tokenizer)
    rows: list[dict] = []
    # Rows are written as each question finishes; Ctrl-C summarises what was measured, then stops.
    stopped = False
    try:
        with open(out / "results.jsonl", "w") as f:
            for i, question in enumerate(prompts):
                done = len(rows) // len(methods)  # requests so far: rotates the running order
                new = _question_rows(target, methods, reference, question, setup, done)
                f.writelines(json.dumps(row) + "\n" for row in new)
                f.flush()
                rows += new
                log.info("question %s done (%d/%d)", question["id"], i + 1, len(prompts))
    except KeyboardInterrupt:
        if not rows:
            raise
        stopped = True
        log.warning("interrupted: summarising the %d requests measured", len(rows) // len(methods))
    meta = {
        "bench": asdict(setup.bench),
        "methods": [m.name for m in methods],
        "num_questions": len(prompts),
        "num_requests": len(rows) // len(methods),
        "threads": torch.get_num_threads(),
        "near_tie_gap": setup.near_tie_gap if setup.near_tie_gap is not None else "auto",
        "target_dtype": str(next(target.model.parameters()).dtype).replace("torch.", ""),
        "target": target.name_or_path,
        "device": str(target.model.device),
        "versions": _versions(),
        "reference": REFERENCE if setup.reference == REFERENCE else methods[0].name,
        **setup.meta,
    }
    if stopped:
        meta["stopped_early"] = f"after {meta['num_requests']} requests (Ctrl-C)"
    baselines = {m.name: getattr(m, "baseline", None) or "plain" for m in methods}
    depths = {m.name: m.max_draft_depth for m in methods}
    summary = report.summarize(rows, depths, meta, baselines)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    report.write_report(summary, out)
    if stopped:
        raise KeyboardInterrupt(f"stopped early; summary of what was measured in {out}")
    return summary


def _versions() -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


# ---- the Hydra edge (evaluate.py) ------------------------------------------------------------


def run(cfg) -> dict:
    """evaluate.py's body: build everything from the composed config, then run_benchmark."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    import heads
    from heads.target import RunTarget
    from train.checkpoint import head_from_checkpoint, is_checkpoint
    from train.config import fold_chat_template

    fold_chat_template(cfg)
    names = check_methods(list(cfg.methods), bool(cfg.head_path) or bool(cfg.get("heads")))
    torch.manual_seed(cfg.seed)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    bench = instantiate(cfg.bench, _convert_="all")
    verifier = instantiate(cfg.verifier, _convert_="all")
    run_target = RunTarget.load(instantiate(cfg.model, _convert_="all"))  # the one reading
    target = run_target.target
    target.model.to(_device(cfg.get("device", "auto")))
    head, meta = None, {"tree": _choice("tree"), "verifier": _choice("verifier")}
    loaded: dict[str, object] = {}  # one copy of a head folder named by several entries
    allow_other = bool(cfg.get("allow_other_target", False))  # heads trained on another model

    def load(path: str):
        if path not in loaded:
            where = path if path.startswith(heads.HUB_PREFIX) else resolve_path(path)
            if is_checkpoint(where):  # RUN/checkpoints/step_N: that step's weights
                where = head_from_checkpoint(where)
            head = heads.from_pretrained(where, target, allow_other_target=allow_other)
            loaded[path] = head.to(target.device).eval()
        return loaded[path]

    if cfg.head_path:
        head = load(str(cfg.head_path))
        meta |= {"head_path": str(cfg.head_path), "head_method": head.method}
        settings = cfg.get("head_settings")
        if settings:
            from heads.base import apply_runtime_settings

            settings = OmegaConf.to_container(settings, resolve=True)
            meta["head_settings"] = apply_runtime_settings(head, settings)
    elif HEAD in names:
        log.warning("head_path is null: running the method 'head' is skipped (%s)", names)
        names = [n for n in names if n != HEAD]
    tree = resolve_tree(OmegaConf.to_container(cfg.tree, resolve=True))  # paths, or dynamic
    meta |= {"tree_nodes": tree.num_nodes, "tree_depth": tree.depth}
    max_context = cfg.get("max_context")
    engine_names = [n for n in names if n in ENGINE_METHODS]
    names = [n for n in names if n not in ENGINE_METHODS]
    methods = build_methods(
        target, names, head, tree, verifier, cfg.prompt_lookup_num_tokens, max_context
    )
    if engine_names:
        methods += _engine_methods(cfg, engine_names, head, run_target, tree, meta)
    extra = cfg.get("heads")
    extra = OmegaConf.to_container(extra, resolve=True) if extra else {}
    if extra:
        meta["heads"] = {}
    for name, entry in extra.items():
        entry = _head_entry(name, entry, {m.name for m in methods})
        head_tree = resolve_tree(entry["tree"])
        one = load(str(entry["path"]))
        methods.append(head_method(target, name, one, head_tree, verifier, max_context))
        meta["heads"][name] = {
            "path": str(entry["path"]),
            "method": one.method,
            "tree": entry["tree"] if isinstance(entry["tree"], str) else "inline",
            "tree_nodes": head_tree.num_nodes,
            "tree_depth": head_tree.depth,
        }
    _check_adapted(target, loaded, meta)
    reference = cfg.get("reference") or REFERENCE
    setup = BenchRun(bench, run_target.config.chat_template, cfg.near_tie_gap, meta, reference)
    out_dir = cfg.get("out_dir") or _hydra_output_dir()
    try:
        summary = run_benchmark(target, methods, setup, out_dir)
    finally:
        for method in methods:
            if hasattr(method, "close"):
                method.close()
    log.info("wrote %s/report.md", out_dir)
    if cfg.get("logger"):
        log_to_tracker(
            summary, out_dir, instantiate(cfg.logger), OmegaConf.to_container(cfg, resolve=True)
        )
    return summary


def check_methods(names: list[str], has_head: bool) -> list[str]:
    """evaluate.py's `methods`, checked before anything loads (the message lists ALL_METHODS)."""
    unknown = [n for n in names if n not in ALL_METHODS]
    if unknown:
        raise ConfigError(
            f"methods={names}: unknown {', '.join(map(repr, unknown))}; use any of "
            f"{', '.join(ALL_METHODS)} (e.g. methods=[plain,hf_generate,head])."
        )
    if set(names) & set(OPENVINO_METHODS):  # the extra, before anything loads
        require_openvino(genai=True)
    if set(names) & set(VLLM_METHODS):  # its tool environment, before anything loads
        vllm_python()  # EngineError naming scripts/setup_vllm.sh
    if set(names) <= {HEAD} and not has_head:
        raise ConfigError(f"methods={names}: nothing to run without head_path; give head_path=DIR.")
    return names


def _engine_methods(cfg, names, head, run_target, tree, meta: dict) -> list:
    """The methods of `names` another engine serves: llama.cpp (eval/bench/llama_cpp.py),
    OpenVINO GenAI (eval/bench/openvino.py) and vLLM (eval/bench/vllm.py), their settings
    resolved into `meta`."""
    out_dir = Path(cfg.get("out_dir") or _hydra_output_dir())
    methods: list = []
    if llama := [n for n in names if n in LLAMA_CPP_METHODS]:
        settings = llama_cpp_settings(cfg, head, run_target, out_dir)
        methods += build_llama_cpp_methods(llama, settings)
        meta["llama_cpp"] = asdict(settings)
    if ov := [n for n in names if n in OPENVINO_METHODS]:
        settings = openvino_settings(cfg, head, run_target.target, out_dir)
        methods += build_openvino_methods(ov, settings, tree, eos_token_ids(run_target.target))
        meta["openvino"] = asdict(settings)
    if served := [n for n in names if n in VLLM_METHODS]:
        settings = vllm_settings(cfg, head, run_target, out_dir, tree.depth)
        methods += build_vllm_methods(served, settings, eos_token_ids(run_target.target))
        meta["vllm"] = asdict(settings)
    return methods


def log_to_tracker(summary: dict, out_dir, logger_cfg, config: dict) -> None:
    """Send the run's config, every method's overall metrics (`bench/<method>/<metric>`), the
    report and the plots to W&B (logger.mode online/offline; nothing when disabled)."""
    from train.tracking import Tracker

    out = Path(out_dir)
    with Tracker(logger_cfg, out) as tracker:
        if tracker.wandb_run is None:
            return
        tracker.log_config(config)
        metrics = {
            f"bench/{name}/{key}": value
            for name, m in summary["methods"].items()
            for key, value in m["overall"].items()
            if isinstance(value, int | float)
        }
        tracker.log(metrics, step=0)
        files = {f"bench/{p.stem}": p for p in sorted(out.glob("*.png"))}
        tracker.log_files(files | {"report": out / "report.md"}, step=0)


def _check_adapted(target, loaded: dict, meta: dict) -> None:
    """A head that adapts the target it is loaded onto (Medusa-2's LoRA) makes every method of
    the run (the baselines too) decode with the adapted target: fine for that head alone, wrong
    for others."""
    adapting = sorted(path for path, head in loaded.items() if type(head).adapts_target)
    meta["target_adapted"] = bool(adapting)
    if adapting and len(loaded) > 1:
        raise ConfigError(
            f"heads {sorted(loaded)}: {adapting[0]} adapts the target (LoRA), which would "
            "change what every other head is verified against; benchmark it in a run of its own."
        )


def _head_entry(name: str, entry, taken: set[str]) -> dict:
    """Check one `heads.NAME: {path, tree}` entry of evaluate.yaml."""
    if name in taken or name in ALL_METHODS:
        raise ConfigError(f"heads.{name}: the name is already a method of this run; rename it.")
    if isinstance(entry, str):
        entry = {"path": entry}
    if not isinstance(entry, dict) or not entry.get("path"):
        raise ConfigError(
            f"heads.{name}={entry!r}: give {{path: HEAD_DIR, tree: tree16|dynamic|...}}."
        )
    unknown = set(entry) - {"path", "tree"}
    if unknown:
        raise ConfigError(f"heads.{name}: unknown keys {sorted(unknown)}; use path and tree.")
    return {"path": entry["path"], "tree": entry.get("tree", "tree16")}


def _device(name: str) -> torch.device:
    """`auto`: the accelerator torch sees (CUDA, ...), else the CPU; or a torch device name."""
    if name == "auto":
        accel = (
            torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        )
        return accel or torch.device("cpu")
    return torch.device(name)


def _choice(group: str) -> str | None:
    """The config group option Hydra picked (e.g. tree=tree16), when running under Hydra."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.choices.get(group) if HydraConfig.initialized() else None


def _hydra_output_dir() -> str:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        raise ValueError("set out_dir=... (no Hydra run dir outside evaluate.py).")
    return HydraConfig.get().runtime.output_dir
