"""Several target types of an engine in one benchmark run, and its fastest plain one.

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

OpenVINO's methods get the same, against the fastest `openvino_plain*` method: its
`openvino.weights` may be a list too (f32, f16, int8, int4 IR weights, eval/bench/openvino.py),
and 4-bit weights are what makes OpenVINO's plain decoding fastest on a small CPU.
`meta.fastest_plain_by_engine` holds each engine's; a speedup is never taken across engines.
"""

from __future__ import annotations

from pathlib import Path

from eval.engine.method_names import split_name

PLAIN = "llama_cpp_plain"
# engine: its plain method
ENGINE_PLAINS = {"llama_cpp": PLAIN, "openvino": "openvino_plain", "vllm": "vllm_plain"}
ENGINE_TITLES = {
    "llama_cpp": ("llama.cpp", "GGUF type"),
    "openvino": ("OpenVINO", "IR weights"),
    "vllm": ("vLLM", "dtype"),
}
DEFINITION = (
    "llama.cpp and OpenVINO methods: tokens_per_s of the method / tokens_per_s of the fastest "
    "plain type of the same engine measured in the same run on the same requests "
    "(meta.fastest_plain_by_engine names it); with one target type it is that type's plain method."
)
MACHINE_DEFINITION = (
    "in a run with an engine's plain method: tokens_per_s of the method / tokens_per_s of the "
    "fastest plain decoding of the run on any engine (plain, hf_generate, llama_cpp_plain*, "
    "openvino_plain*, vllm_plain; meta.fastest_plain_machine names it), same requests."
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


def fastest_plain(methods: dict, plain: str = PLAIN) -> str | None:
    """The `<plain>*` method (default `llama_cpp_plain`) with the most overall tokens/s (None: no
    such method has a rate). `methods`: summary["methods"]."""
    rates = {
        name: entry["overall"].get("tokens_per_s")
        for name, entry in methods.items()
        if split_name(name)[0] == plain
    }
    rates = {n: r for n, r in rates.items() if r}
    return max(rates, key=rates.get) if rates else None


def _types(meta: dict, engine: str) -> dict:
    """{label: weight type} of `engine`'s target entries in this run ("" for a single one)."""
    settings = meta.get(engine) or {}
    if engine == "llama_cpp":
        return settings.get("resolved_types") or {}
    if engine == "vllm":  # one target, in the run's dtype
        return {"": str(settings["dtype"])} if settings.get("dtype") else {}
    weights = settings.get("weights")  # openvino: the labels are the weight types themselves
    if isinstance(weights, (list, tuple)):
        return {str(w): str(w) for w in weights}
    return {"": str(weights)} if weights else {}


def add_fastest_plain(summary: dict) -> None:
    """Add `speedup_vs_fastest_plain` to every method of an engine with a plain run (llama.cpp,
    OpenVINO; overall and per category): against the fastest plain method of *that* engine.
    `meta.fastest_plain_by_engine[engine]` = {method, type, tokens_per_s}; `meta.fastest_plain`
    keeps llama.cpp's, as before. Nothing for an engine without a plain run."""
    methods, meta = summary["methods"], summary["meta"]
    for engine, plain in ENGINE_PLAINS.items():
        best = fastest_plain(methods, plain)
        if best is None:
            continue
        best_overall = methods[best]["overall"]
        found = {
            "method": best,
            "type": _types(meta, engine).get(split_name(best)[1]),
            "tokens_per_s": best_overall["tokens_per_s"],
        }
        meta.setdefault("fastest_plain_by_engine", {})[engine] = found
        if engine == "llama_cpp":
            meta["fastest_plain"] = found
        summary["definitions"]["speedup_vs_fastest_plain"] = DEFINITION
        for name, entry in methods.items():
            if not name.startswith(f"{engine}_"):
                continue
            groups = [(entry["overall"], best_overall)]
            groups += [
                (m, methods[best]["categories"].get(c)) for c, m in entry["categories"].items()
            ]
            for metrics, base in groups:
                ok = base and base.get("tokens_per_s") and metrics.get("tokens_per_s")
                metrics["speedup_vs_fastest_plain"] = (
                    metrics["tokens_per_s"] / base["tokens_per_s"] if ok else None
                )


def add_machine_fastest_plain(summary: dict) -> None:
    """In a run with an engine's plain method, add `speedup_vs_machine_fastest_plain` to every
    method (overall): against the fastest plain decoding of the run on any engine (`plain`,
    `hf_generate` or an engine's plain method), named in `meta.fastest_plain_machine`. The
    number a user of this machine cares about: a draft that beats its own engine's plain
    decoding can still be slower than another engine's."""
    methods = summary["methods"]
    plains = {"plain", "hf_generate", *ENGINE_PLAINS.values()}
    rates = {
        name: entry["overall"].get("tokens_per_s")
        for name, entry in methods.items()
        if split_name(name)[0] in plains
    }
    rates = {n: r for n, r in rates.items() if r}
    if not rates or not any(split_name(n)[0] in ENGINE_PLAINS.values() for n in rates):
        return
    best = max(rates, key=rates.get)
    summary["meta"]["fastest_plain_machine"] = {"method": best, "tokens_per_s": rates[best]}
    summary["definitions"]["speedup_vs_machine_fastest_plain"] = MACHINE_DEFINITION
    for entry in methods.values():
        rate = entry["overall"].get("tokens_per_s")
        entry["overall"]["speedup_vs_machine_fastest_plain"] = rate / rates[best] if rate else None


def machine_fastest_plain_lines(summary: dict) -> list[str]:
    """report.md: every method against the run's fastest plain decoding on any engine."""
    found = summary["meta"].get("fastest_plain_machine")
    if not found:
        return []
    lines = [
        "",
        "## Against the fastest plain decoding of this machine",
        "",
        f"Fastest plain decoding in this run, any engine: `{found['method']}` "
        f"({found['tokens_per_s']:.1f} tokens/s).",
        "",
        "| method | tokens/s | speedup vs the machine's fastest plain |",
        "|---|---|---|",
    ]
    for name, entry in summary["methods"].items():
        m = entry["overall"]
        rate, ratio = m.get("tokens_per_s"), m.get("speedup_vs_machine_fastest_plain")
        lines.append(
            f"| {name} | {'-' if rate is None else f'{rate:.1f}'} | "
            f"{'-' if ratio is None else f'{ratio:.2f}'} |"
        )
    return lines


def fastest_plain_lines(summary: dict) -> list[str]:
    """report.md: per engine, its fastest plain type and each of its methods against that and
    against its own type's plain decoding."""
    by_engine = summary["meta"].get("fastest_plain_by_engine") or {}
    if not by_engine and summary["meta"].get("fastest_plain"):  # summaries written before
        by_engine = {"llama_cpp": summary["meta"]["fastest_plain"]}

    def fmt(v):
        return "-" if v is None else f"{v:.2f}"

    lines: list[str] = []
    for engine, found in by_engine.items():
        title, kind = ENGINE_TITLES.get(engine, (engine, "type"))
        lines += [
            "",
            f"## {title} against the fastest plain type",
            "",
            f"Fastest plain {title} decoding in this run: `{found['method']}` ({kind} "
            f"{found['type'] or '?'}, {found['tokens_per_s']:.1f} tokens/s).",
            "",
            "| method | tokens/s | speedup vs its own type's plain | speedup vs fastest plain |",
            "|---|---|---|---|",
        ]
        for name, entry in summary["methods"].items():
            m = entry["overall"]
            if name.startswith(f"{engine}_") and "speedup_vs_fastest_plain" in m:
                rate = "-" if m["tokens_per_s"] is None else f"{m['tokens_per_s']:.1f}"
                lines.append(
                    f"| {name} | {rate} | {fmt(m['speedup_vs_plain'])} | "
                    f"{fmt(m['speedup_vs_fastest_plain'])} |"
                )
    return lines
