"""The model card (README.md) of an exported draft: Hub metadata, what the draft is, what it was
trained on, what it measured, and how to serve it.

The card is meant for a public page, so it names local files without the machine's folders: a
file inside the project by its path in the project, any other by its name and a content hash.
What the method is comes from the head class (`title`, `hub_tag`), how to serve a format from
heads.interop.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import yaml

from data.paths import REPO_ROOT
from heads.interop import export_notes, serve_commands

METRICS = ("tau", "tokens_per_s", "speedup_vs_plain", "greedy_mismatches", "requests")


def public_path(text: str) -> str:
    """`text` as a public page may show it: a local file or folder relative to the project, or
    outside it by its name (plus a sha256 prefix for a file); other names (Hub datasets, paths
    that are not here) as given, unless they climb out of the working folder."""
    path = Path(text).expanduser()
    if not (path.is_absolute() or path.exists() or text.startswith(("~", ".."))):
        return text
    full = path.resolve()
    if full.is_relative_to(REPO_ROOT):
        return full.relative_to(REPO_ROOT).as_posix()
    if full.is_file():
        return f"{full.name} (sha256 {_sha256(full)[:12]})"
    return full.name


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_hub_id(name: str) -> bool:
    """True for an owner/name the Hub could hold (not a local name, a file or a bare word)."""
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name)) and not Path(name).exists()


def _front_matter(base: str, head, fmt: str) -> str:
    tag = type(head).hub_tag
    tags = ["speculative-decoding", "draftsmith", tag]
    if fmt not in ("native", tag):
        tags.append(fmt)
    meta = {"library_name": "draftsmith", "tags": tags}
    if is_hub_id(base):  # a local name is no Hub model: the card says it in its text only
        meta = {"base_model": base} | meta
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
            lines.append(f"- `{public_path(str(p['path']))}`{rows}")
    elif data.get("sources"):
        lines.append("Human-written conversations:")
        for s in data["sources"]:
            rows = f" (first {s['max_rows']} rows)" if s.get("max_rows") else ""
            lines.append(f"- `{public_path(str(s.get('path')))}`{rows}")
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
    from heads.shipped import by_hub_id

    base = public_path(target.name_or_path)
    shipped = by_hub_id(base)
    where = repo or "DRAFT_DIR"
    named = f"[{base}](https://huggingface.co/{base})" if is_hub_id(base) else f"`{base}`"
    lines = [
        _front_matter(base, head, fmt),
        f"# {type(head).title} for {base}",
        "",
        f"A speculative-decoding draft for {named}, trained with "
        "draftsmith on the frozen target and exported in the "
        f"`{fmt}` format. Speculative decoding with it is lossless: the target verifies every "
        "drafted token, so greedy output equals the target's own.",
        "",
    ]
    if shipped:
        lines += [
            f"The target used for training and measurement was the `{shipped.alias}` GGUF "
            f"({shipped.weight_type.upper()}) shipped in PyPI wheels, de-quantized; acceptance on "
            "the full-precision model may differ slightly.",
            "",
        ]
    lines += ["## Serve it", "", "```bash", *serve_commands(fmt, base, where, config), "```", ""]
    for note in export_notes(head, fmt):
        lines += [note, ""]
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
