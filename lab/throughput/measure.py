"""Feature and training throughput (docs/reports/2026-12-01-throughput/throughput.md,
scripts/bench_train_throughput.py):
tokens/s of feature extraction (fp32 target, bf16 weights, bf16 autocast) with the bf16 features'
error against fp32, training-step tokens/s per head with padded and packed
(`trainer.pack_tokens`) batches, in bf16 autocast (`trainer.mixed_precision=bf16` on a CPU) and
with the targets a head derives once per example, and disk feature-cache reads. Every ratio is
measured within one run, on the same data: the variants take turns, so load from other jobs
falls on all of them.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

DATA = "data/corpora/oasst_en/conversations.jsonl"
PARTS = ("extraction", "train", "disk")


def default_heads() -> list[str]:
    """The heads with a conf/head entry and a *_llama experiment (Medusa-2 trains its own
    adapter, so it is left out)."""
    from data.paths import resolve_path

    conf = Path(resolve_path("conf"))
    return [
        p.stem
        for p in sorted((conf / "head").glob("*.yaml"))
        if (conf / "experiment" / f"{p.stem}_llama.yaml").is_file()
        and "lora_rank" not in p.read_text()
    ]


@dataclass
class ThroughputSettings:
    """What to measure: `examples` oasst_en conversations from `skip` on, cut to `max_length`
    tokens, on the conf/model target `model`; `steps` timed training steps per head and variant
    in batches of `batch_size` (packed rows of `pack_tokens`); `parts` of PARTS (train alone
    still extracts fp32 features once, untimed). Writes `out` (markdown) and its .json."""

    model: str = "smollm2_135m"
    examples: int = 32
    skip: int = 200
    max_length: int = 512
    batch_size: int = 8
    steps: int = 3
    pack_tokens: int = 512
    heads: list[str] = field(default_factory=default_heads)
    threads: int = 2
    parts: list[str] = field(default_factory=lambda: list(PARTS))
    out: Path = Path("docs/reports/2026-12-01-throughput/throughput.md")

    def __post_init__(self) -> None:
        unknown = sorted(set(self.parts) - set(PARTS))
        if unknown:
            raise ValueError(f"parts {unknown}: measure any of {', '.join(PARTS)}.")
        if min(self.examples, self.batch_size, self.steps) < 1:
            raise ValueError("examples, batch_size and steps must be at least 1.")


def load_examples(target, count: int, max_length: int, skip: int) -> list[dict]:
    from data.dataset import DataSource, build_examples, load_conversations
    from data.paths import resolve_path

    rows = load_conversations([DataSource(str(resolve_path(DATA)), max_rows=skip + count)])
    return build_examples(rows[skip:], target.tokenizer, max_length)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


# ---- feature extraction ------------------------------------------------------------------------


def extraction(target, examples, layers, chunk: int = 4) -> tuple[dict, list[dict]]:
    """fp32, bf16 weights and bf16 autocast extraction of the same examples, and how far the
    bf16 features land from fp32 (cosine, relative error, lm_head top-1 agreement).

    The variants take turns chunk by chunk, so load from other jobs falls on all of them."""
    from data.features import compute_features
    from heads.target import Target

    bf16_model = copy.deepcopy(target.model).to(torch.bfloat16)
    bf16_target = Target.from_model(bf16_model, target.tokenizer, name_or_path="bf16")
    run = dict(layers=layers, dtype=torch.float32, progress=False)
    variants = {
        "fp32": lambda part: compute_features(part, target, **run),
        "bf16_weights": lambda part: compute_features(part, bf16_target, **run),
        "bf16_autocast": lambda part: compute_features(part, target, autocast="bfloat16", **run),
    }
    feats = {name: [] for name in variants}
    seconds = dict.fromkeys(variants, 0.0)
    for c, first in enumerate(range(0, len(examples), chunk)):
        part = examples[first : first + chunk]
        names = list(variants)
        for name in names[c % 3 :] + names[: c % 3]:  # rotate who goes first
            out, took = timed(lambda f=variants[name], p=part: f(p))
            feats[name] += out
            seconds[name] += took
    tokens = sum(len(e["input_ids"]) for e in examples)
    result = {"tokens": tokens}
    for name in variants:
        result[name] = {"seconds": seconds[name], "tokens_per_s": tokens / seconds[name]}
        if name != "fp32":
            result[name]["speedup"] = seconds["fp32"] / seconds[name]
            result[name].update(feature_error(target, feats["fp32"], feats[name]))
    return result, feats["fp32"]


@torch.no_grad()
def feature_error(target, want: list[dict], got: list[dict]) -> dict:
    """Mean cosine and relative L2 error of "hidden" and "aux" rows, and how often the target's
    lm_head (fp32) picks the same top-1 token from the two "hidden" features."""
    out = {}
    for key in ("hidden", "aux"):
        if key not in want[0]:
            continue
        a = torch.cat([e[key] for e in want]).float()
        b = torch.cat([e[key] for e in got]).float()
        out[f"{key}_cosine"] = float(torch.cosine_similarity(a, b, dim=-1).mean())
        out[f"{key}_rel_err"] = float((a - b).norm(dim=-1).div(a.norm(dim=-1)).mean())
    weight = target.lm_head.weight.float()
    a = torch.cat([e["hidden"] for e in want]).float()
    b = torch.cat([e["hidden"] for e in got]).float()
    same = [
        (x @ weight.t()).argmax(-1) == (y @ weight.t()).argmax(-1)
        for x, y in zip(a.split(512), b.split(512), strict=True)
    ]
    out["lm_head_top1_agree"] = float(torch.cat(same).float().mean())
    return out


# ---- training steps ----------------------------------------------------------------------------


def head_config(kind: str):
    """The head as the *_llama experiment trains it (conf/head + the experiment's head: block)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from data.paths import resolve_path

    base = OmegaConf.load(resolve_path(f"conf/head/{kind}.yaml"))
    experiment = OmegaConf.load(resolve_path(f"conf/experiment/{kind}_llama.yaml"))
    return instantiate(OmegaConf.merge(base, experiment.get("head", {})))


def train_steps(target, examples, batch_size, steps, variants: dict) -> dict:
    """Tokens/s of `steps` optimizer steps (after one warm-up step) on cached features, for
    each variant name -> (head config, pack_tokens[, autocast dtype[, derive]]), derive: the
    batches carry the head's `example_targets` (as training adds them); the variants take turns
    step by step. An autocast variant runs the forward under `torch.autocast` (bf16 matmuls, on
    AMX where the CPU has it) with float32 weights and optimizer, as
    `trainer.mixed_precision=bf16` trains."""
    import heads
    from data.dataset import collate, pack_examples
    from heads.vocab import count_tokens
    from train.config import TrainerConfig
    from train.features import batch_features
    from train.optim import build_optimizer

    groups = [examples[i : i + batch_size] for i in range(0, len(examples), batch_size)]
    groups = [g for g in groups if len(g) == batch_size][: steps + 1]
    pad = target.tokenizer.pad_token_id or 0
    counts = count_tokens(examples, target.vocab_size)
    runs = {}
    for name, (config, pack_tokens, *more) in variants.items():
        cast, derive = (more + [None, False])[:2]
        torch.manual_seed(0)
        head = heads.build_head(config, target, counts).train()
        optimizer = build_optimizer(head, TrainerConfig(lr=1e-4))
        if derive:  # the per-example targets training derives once and keeps (not timed)
            rows = [[{**e, **head.example_targets(e)} for e in g] for g in groups]
        else:
            rows = groups
        batches = [collate(pack_examples(g, pack_tokens) if pack_tokens else g, pad) for g in rows]
        total = {"tokens": 0, "slots": 0, "seconds": 0.0, "losses": []}
        runs[name] = (head, optimizer, batches, total, cast)
    for i in range(len(groups)):
        names = list(runs)
        for name in names[i % len(names) :] + names[: i % len(names)]:
            head, optimizer, batches, total, cast = runs[name]
            batch = batches[i]
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=cast or torch.bfloat16, enabled=cast is not None):
                out = head.loss(batch, batch_features(batch, None, head.feature_layers(), head))
            out.loss.backward()
            total["losses"].append(round(float(out.loss.detach()), 4))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if i:  # the first step warms up (allocations, kernels)
                total["seconds"] += time.perf_counter() - start
                total["tokens"] += int(batch["attention_mask"].sum())
                total["slots"] += batch["input_ids"].numel()
    return {
        name: {
            "steps": len(groups) - 1,
            "tokens": t["tokens"],
            "padding": 1 - t["tokens"] / t["slots"],
            "seconds": t["seconds"],
            "tokens_per_s": t["tokens"] / t["seconds"],
            "losses": t["losses"],
        }
        for name, (_, _, _, t, _) in runs.items()
    }


# ---- disk cache ---------------------------------------------------------------------------------


def disk_cache(target, examples, layers) -> dict:
    """Build an fp16 disk cache (extraction + write) and read it back through the dataset."""
    from data.dataset import collate
    from data.feature_cache import open_or_build_feature_cache

    tokens = sum(len(e["input_ids"]) for e in examples)
    with tempfile.TemporaryDirectory() as folder:
        build = lambda: open_or_build_feature_cache(  # noqa: E731
            examples, target, folder, layers, "float16", progress=False
        )
        dataset, t_build = timed(build)

        def read():
            for i in range(0, len(dataset), 8):
                collate([dataset[j] for j in range(i, min(i + 8, len(dataset)))])

        _, t_read = timed(read)
        size = sum(p.stat().st_size for p in Path(folder).iterdir())
    return {
        "tokens": tokens,
        "build_tokens_per_s": tokens / t_build,
        "read_tokens_per_s": tokens / t_read,
        "bytes_per_token": size / tokens,
    }


# ---- the whole benchmark -------------------------------------------------------------------------


def measure(target, examples, layers, settings: ThroughputSettings, configs=None, log=print):
    """The report's measurements (keys "extraction", "train", "disk_cache" as `settings.parts`
    asks) on `examples`, with features of `layers` (EAGLE-3's). configs: head kind -> head
    config (default: head_config(kind) for each of settings.heads); log: each part's numbers."""
    import heads
    from data.features import compute_features
    from heads.vocab import count_tokens

    report: dict = {}
    if "extraction" in settings.parts:
        report["extraction"], features = extraction(target, examples, layers)
        log(json.dumps(report["extraction"], indent=1))
    else:
        features = compute_features(examples, target, layers, dtype=torch.float32)
    kinds = settings.heads if "train" in settings.parts else []
    configs = configs or {kind: head_config(kind) for kind in kinds}
    by_layers = {tuple(layers): _as_cached(features)}
    counts = count_tokens(examples, target.vocab_size)
    report["train"] = {}
    for kind in kinds:
        config = configs[kind]
        need = tuple(heads.build_head(config, target, counts).feature_layers() or layers)
        if need not in by_layers:  # DFlash and DSpark fuse other layers than EAGLE-3
            fresh = compute_features(examples, target, list(need), dtype=torch.float32)
            by_layers[need] = _as_cached(fresh)
        variants = _train_variants(kind, config, settings.pack_tokens)
        runs = train_steps(target, by_layers[need], settings.batch_size, settings.steps, variants)
        report["train"][kind] = runs
        log(f"{kind} {json.dumps(runs)}")
    if "disk" in settings.parts:
        report["disk_cache"] = disk_cache(target, examples[:8], layers)
        log(json.dumps(report["disk_cache"]))
    return report


def _as_cached(features: list[dict]) -> list[dict]:
    """The features as the fp16 disk cache stores them."""
    return [{**e, **{k: e[k].half() for k in ("hidden", "aux") if k in e}} for e in features]


def _train_variants(kind: str, config, pack_tokens: int) -> dict:
    """train_steps' variants of one head: padded, packed, packed in bf16 autocast, with the
    per-example targets where the head derives any, and EAGLE-3 without its vocabulary mask."""
    import heads

    variants = {
        "padded": (config, None),
        "packed": (config, pack_tokens),
        "packed, bf16 autocast": (config, pack_tokens, torch.bfloat16),
    }
    if hasattr(heads.HEAD_CLASSES.get(kind, object), "example_targets"):
        for cast in (None, torch.bfloat16):
            label = "packed, example targets" + (", bf16 autocast" if cast else "")
            variants[label] = (config, pack_tokens, cast, True)
    if getattr(config, "mask_outside_vocab", False):  # what its full-vocabulary argmax costs
        plain = dataclasses.replace(config, mask_outside_vocab=False)
        variants["padded, mask_outside_vocab=false"] = (plain, None)
    return variants


def run(settings: ThroughputSettings, command: str) -> dict:
    """Measure on the settings' target and data, write settings.out (markdown) and its .json,
    and return the report. command: how it was started, for the report's header."""
    from heads.eagle3 import default_aux_layers
    from lab.throughput.report import markdown
    from train.rundir import load_conf_target

    torch.set_num_threads(settings.threads)
    target = load_conf_target(settings.model)
    examples = load_examples(target, settings.examples, settings.max_length, settings.skip)
    report = {
        "command": command,
        "machine": f"{platform.machine()}, {settings.threads} thread(s), torch {torch.__version__}",
        "examples": len(examples),
        "max_length": settings.max_length,
        "batch_size": settings.batch_size,
    }
    layers = default_aux_layers(target.num_layers)
    report |= measure(target, examples, layers, settings, log=lambda s: print(s, flush=True))
    out = Path(settings.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(report))
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    return report


__all__ = [
    "ThroughputSettings",
    "default_heads",
    "disk_cache",
    "extraction",
    "feature_error",
    "measure",
    "run",
    "train_steps",
]
