"""docs/reports/2026-12-01-throughput/throughput.md from a throughput report
(lab/throughput/measure.py): a table per part measured, then what the settings measured mean."""

from __future__ import annotations


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
