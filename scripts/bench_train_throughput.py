"""Feature and training throughput on the embedded target (issue 13): tokens/s of feature
extraction (fp32 target, bf16 weights, bf16 autocast) with the bf16 features' error against
fp32, training-step tokens/s per head with padded and packed (`trainer.pack_tokens`) batches,
in bf16 autocast (`trainer.mixed_precision=bf16` on a CPU) and with the targets a head derives
once per example, and disk feature-cache reads. Every ratio is measured within one run, on the
same data.

    nice -n 5 python scripts/bench_train_throughput.py --examples 32 --steps 4

Writes docs/throughput.md (a table) and docs/throughput.json beside it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

# the heads with a conf/head entry and a *_llama experiment (Medusa-2 trains its own adapter)
_CONF = Path(__file__).resolve().parents[1] / "conf"
HEADS = tuple(
    p.stem
    for p in sorted((_CONF / "head").glob("*.yaml"))
    if (_CONF / "experiment" / f"{p.stem}_llama.yaml").is_file()
    and "lora_rank" not in p.read_text()
)
DATA = "data/corpora/oasst_en/conversations.jsonl"


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


# ---- report -------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    return "\n".join(
        [
            "# Feature and training throughput",
            "",
            f"Measured by `{report['command']}` on {report['machine']}, SmolLM2-135M "
            f"({report['examples']} oasst_en conversations, max_length {report['max_length']}); "
            "other jobs shared the CPU, so compare the ratios within this run rather than "
            "absolute numbers across runs.",
            "",
            *(extraction_lines(report["extraction"]) if "extraction" in report else []),
            *(train_lines(report) if report.get("train") else []),
            *(disk_lines(report["disk_cache"]) if "disk_cache" in report else []),
            *SETTINGS,
        ]
    )


def extraction_lines(ex: dict) -> list[str]:
    lines = [
        f"## Feature extraction ({ex['tokens']} tokens, EAGLE-3's fused layers included)",
        "",
        "| target | tokens/s | speedup | hidden cosine | hidden rel. err | aux rel. err "
        "| lm_head top-1 agree |",
        "|---|---|---|---|---|---|---|",
        f"| fp32 | {ex['fp32']['tokens_per_s']:.0f} | 1.00 | 1 | 0 | 0 | 1 |",
    ]
    for name in ("bf16_weights", "bf16_autocast"):
        r = ex[name]
        lines.append(
            f"| {name} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f} | {r['hidden_cosine']:.5f} "
            f"| {r['hidden_rel_err']:.4f} | {r.get('aux_rel_err', float('nan')):.4f} "
            f"| {r['lm_head_top1_agree']:.4f} |"
        )
    return lines + [""]


def train_lines(report: dict) -> list[str]:
    lines = [
        f"## Training steps (batch_size {report['batch_size']}, cached features, "
        "the *_llama head settings)",
        "",
        "| head | padded tokens/s | padding | packed tokens/s | packed padding | speedup |",
        "|---|---|---|---|---|---|",
    ]
    extra = []
    for name, r in report["train"].items():
        p, q = r["padded"], r["packed"]
        lines.append(
            f"| {name} | {p['tokens_per_s']:.0f} | {p['padding']:.0%} | {q['tokens_per_s']:.0f} "
            f"| {q['padding']:.0%} | {q['tokens_per_s'] / p['tokens_per_s']:.2f} |"
        )
        for variant, v in r.items():
            if variant not in ("padded", "packed"):
                base = q if variant.startswith("packed") else p
                ratio = v["tokens_per_s"] / base["tokens_per_s"]
                extra.append(
                    f"- {name} {variant}: {v['tokens_per_s']:.0f} tokens/s ({ratio:.2f}x "
                    f"{'packed' if base is q else 'padded'})"
                )
    return lines + [""] + extra + ([""] if extra else [])


def disk_lines(d: dict) -> list[str]:
    return [
        "## Disk feature cache (float16, EAGLE-3's layers)",
        "",
        f"build (extraction + write): {d['build_tokens_per_s']:.0f} tokens/s; read + collate: "
        f"{d['read_tokens_per_s']:.0f} tokens/s; {d['bytes_per_token']:.0f} bytes/token.",
        "",
    ]


SETTINGS = [
    "## The settings measured",
    "",
    "- `trainer.pack_tokens=N` packs each micro-batch's `batch_size` conversations into rows",
    "  of at most N tokens (null: padded rows). Attention is block-diagonal, positions",
    "  restart per conversation and no label crosses a boundary, so the loss equals the",
    "  padded batch's (tests/test_packing.py); data order and resume are unchanged.",
    "  It pays only where it removes more padding than the longer rows add in attention",
    "  (quadratic in the row length): `pack_tokens` = `data.max_length` keeps rows no longer",
    "  than the padded ones. Medusa projects only loss positions, so padding costs it little.",
    "- bf16_weights is the target loaded with `model.dtype=bfloat16` (it would also make",
    "  the evaluated target bf16); bf16_autocast keeps float32 weights and runs the",
    '  feature forward under `torch.autocast` (`compute_features(..., autocast="bfloat16")`,',
    "  also taken by `LazyFeatureDataset` and `open_or_build_feature_cache`, which record it",
    "  in the cache's metadata; in training, `data.feature_autocast=bfloat16`).",
    "- `mask_outside_vocab=false` shows what EAGLE-3's full-vocabulary argmax costs when",
    "  every step recomputes it from the cached features.",
    '- "bf16 autocast" runs the training step as `trainer.mixed_precision=bf16` does on a',
    "  CPU: the forward under `torch.autocast` (bf16 matmuls, on AMX where the CPU has it),",
    "  float32 weights, gradients and optimizer. The per-step losses are in the .json.",
    '- "example targets": the batches carry what the head derives once per example',
    "  (`example_targets`; EAGLE-3's target greedy tokens, computed in float32 and kept for",
    "  every epoch by `train.features.ExampleTargets`), so the step skips that projection.",
    "  Deriving them is not timed: training pays it once per example, in the first epoch.",
    "",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model option")
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--skip", type=int, default=200, help="start at this conversation")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per head and mode")
    parser.add_argument("--pack-tokens", type=int, default=512)
    parser.add_argument("--heads", nargs="+", default=list(HEADS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["extraction", "train", "disk"],
        help="what to measure (train alone still extracts fp32 features once, untimed)",
    )
    parser.add_argument("--out", type=Path, default=Path("docs/throughput.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from data.features import compute_features
    from heads.eagle3 import default_aux_layers
    from train.rundir import load_conf_target

    target = load_conf_target(args.model)
    examples = load_examples(target, args.examples, args.max_length, args.skip)
    layers = default_aux_layers(target.num_layers)
    flags = [
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
    ]
    report = {
        "command": "python scripts/bench_train_throughput.py " + " ".join(flags),
        "machine": f"{platform.machine()}, {args.threads} thread(s), torch {torch.__version__}",
        "examples": len(examples),
        "max_length": args.max_length,
        "batch_size": args.batch_size,
    }
    if "extraction" in args.parts:
        report["extraction"], features = extraction(target, examples, layers)
        print(json.dumps(report["extraction"], indent=1), flush=True)
    else:
        features = compute_features(examples, target, layers, dtype=torch.float32)
    if "train" not in args.parts:
        args.heads = []
    import heads
    from heads.vocab import count_tokens

    def cached(features: list[dict]) -> list[dict]:  # as the fp16 disk cache stores them
        return [{**e, **{k: e[k].half() for k in ("hidden", "aux")}} for e in features]

    by_layers = {tuple(layers): cached(features)}
    counts = count_tokens(examples, target.vocab_size)
    report["train"] = {}
    for kind in args.heads:
        config = head_config(kind)
        need = tuple(heads.build_head(config, target, counts).feature_layers() or layers)
        if need not in by_layers:  # DFlash and DSpark fuse other layers than EAGLE-3
            fresh = compute_features(examples, target, list(need), dtype=torch.float32)
            by_layers[need] = cached(fresh)
        half = by_layers[need]
        variants = {
            "padded": (config, None),
            "packed": (config, args.pack_tokens),
            "packed, bf16 autocast": (config, args.pack_tokens, torch.bfloat16),
        }
        if hasattr(heads.HEAD_CLASSES.get(kind, object), "example_targets"):
            for cast in (None, torch.bfloat16):
                label = "packed, example targets" + (", bf16 autocast" if cast else "")
                variants[label] = (config, args.pack_tokens, cast, True)
        if getattr(config, "mask_outside_vocab", False):  # what its full-vocabulary argmax costs
            plain = dataclasses.replace(config, mask_outside_vocab=False)
            variants["padded, mask_outside_vocab=false"] = (plain, None)
        report["train"][kind] = train_steps(target, half, args.batch_size, args.steps, variants)
        print(kind, json.dumps(report["train"][kind]), flush=True)
    if "disk" in args.parts:
        report["disk_cache"] = disk_cache(target, examples[:8], layers)
        print(json.dumps(report["disk_cache"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(report))
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
