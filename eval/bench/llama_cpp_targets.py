"""Several llama.cpp target types in one benchmark run, and the fastest plain one.

`llama_cpp.target_gguf` takes one choice (`auto`, a type, a .gguf path) or a list of them,
e.g. `llama_cpp.target_gguf=[q4_0,bf16,auto]`. With a list, every llama.cpp method runs once
per entry, named `<method>@<entry>` (`llama_cpp_plain@q4_0`, `llama_cpp_draft@q4_0`, ...), and
each drafted method's baseline is the plain method of its own type. One choice keeps the
plain names.

A speedup against the same type's plain decoding flatters a draft served on a slow type: the
embedded Q4_1 file verifies row by row on x86, so a draft there beats its own baseline while
staying slower than plain Q4_0. So every llama.cpp method also gets `speedup_vs_fastest_plain`:
its tokens/s over that of the fastest `llama_cpp_plain*` method of the same run on the same
requests, and the summary's meta names that method and its GGUF type (`fastest_plain`).
"""

from __future__ import annotations

from pathlib import Path

from eval.engine.method_names import split_name

PLAIN = "llama_cpp_plain"
DEFINITION = (
    "llama.cpp methods: tokens_per_s of the method / tokens_per_s of the fastest plain llama.cpp "
    "type measured in the same run on the same requests (meta.fastest_plain names it); with one "
    "target type it is that type's `llama_cpp_plain`."
)


def _label(choice: str) -> str:
    return Path(choice).stem if choice.endswith(".gguf") else choice


def resolve_target_ggufs(model_cfg, choice) -> tuple[str | dict[str, str], dict[str, str]]:
    """(target_gguf, types): one choice -> its path and {"": its GGUF type}; a list -> {label:
    path} and {label: GGUF type}, labels being the choices (a path's file stem)."""
    from heads.interop.gguf import TargetGGUF, gguf_for_target, gguf_type_name

    if isinstance(choice, (list, tuple)):
        if not choice:
            raise ValueError("llama_cpp.target_gguf is an empty list; name at least one type.")
        labels = [_label(str(c)) for c in choice]
        if len(set(labels)) != len(labels):
            raise ValueError(f"llama_cpp.target_gguf names one entry twice: {list(choice)}.")
        paths = {
            lab: str(gguf_for_target(model_cfg, TargetGGUF.parse(str(c))))
            for lab, c in zip(labels, choice)
        }
        return paths, {lab: gguf_type_name(p) for lab, p in paths.items()}
    path = str(gguf_for_target(model_cfg, TargetGGUF.parse(choice)))
    return path, {"": gguf_type_name(path)}


def fastest_plain(methods: dict) -> str | None:
    """The `llama_cpp_plain*` method with the most overall tokens/s (None: no plain llama.cpp
    method has a rate). `methods`: summary["methods"]."""
    rates = {
        name: entry["overall"].get("tokens_per_s")
        for name, entry in methods.items()
        if split_name(name)[0] == PLAIN
    }
    rates = {n: r for n, r in rates.items() if r}
    return max(rates, key=rates.get) if rates else None


def add_fastest_plain(summary: dict) -> None:
    """Add `speedup_vs_fastest_plain` to every llama.cpp method (overall and per category) and
    `meta.fastest_plain` = {method, type, tokens_per_s}; nothing without a plain llama.cpp run."""
    methods = summary["methods"]
    best = fastest_plain(methods)
    if best is None:
        return
    types = (summary["meta"].get("llama_cpp") or {}).get("resolved_types") or {}
    best_overall = methods[best]["overall"]
    summary["meta"]["fastest_plain"] = {
        "method": best,
        "type": types.get(split_name(best)[1]),
        "tokens_per_s": best_overall["tokens_per_s"],
    }
    summary["definitions"]["speedup_vs_fastest_plain"] = DEFINITION
    for name, entry in methods.items():
        if not name.startswith("llama_cpp_"):
            continue
        groups = [(entry["overall"], best_overall)]
        groups += [(m, methods[best]["categories"].get(c)) for c, m in entry["categories"].items()]
        for metrics, base in groups:
            ok = base and base.get("tokens_per_s") and metrics.get("tokens_per_s")
            metrics["speedup_vs_fastest_plain"] = (
                metrics["tokens_per_s"] / base["tokens_per_s"] if ok else None
            )


def fastest_plain_lines(summary: dict) -> list[str]:
    """report.md: the fastest plain type and each llama.cpp method against it and its own."""
    found = summary["meta"].get("fastest_plain")
    if not found:
        return []

    def fmt(v):
        return "-" if v is None else f"{v:.2f}"

    lines = [
        "",
        "## llama.cpp against the fastest plain type",
        "",
        f"Fastest plain llama.cpp decoding in this run: `{found['method']}` (GGUF type "
        f"{found['type'] or '?'}, {found['tokens_per_s']:.1f} tokens/s).",
        "",
        "| method | tokens/s | speedup vs its own type's plain | speedup vs fastest plain |",
        "|---|---|---|---|",
    ]
    for name, entry in summary["methods"].items():
        m = entry["overall"]
        if "speedup_vs_fastest_plain" in m:
            rate = "-" if m["tokens_per_s"] is None else f"{m['tokens_per_s']:.1f}"
            lines.append(
                f"| {name} | {rate} | {fmt(m['speedup_vs_plain'])} | "
                f"{fmt(m['speedup_vs_fastest_plain'])} |"
            )
    return lines
