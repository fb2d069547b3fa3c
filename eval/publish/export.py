"""Export a trained draft to a folder a serving engine loads, and prove the export.

`export_draft(source, fmt, out)` takes a run dir (its best_head, else head) or a head folder and
writes `out/` with `config.json`, one `model.safetensors` (heads.interop lays out each format), a
model card `README.md` and, when a benchmark run is given, its plots. Before `out/` appears, the
folder is re-imported and decoded greedily on a few prompts next to the in-memory head: both must
give the same tokens and the same accept length at every step (so the same tau), or the export
fails and `out` is left as it was (heads.base.atomic_save_dir swaps the folder in at the end).
`push=REPO` then uploads the folder (eval/publish/hub.py).

This step needs the harness (eval/), so it sits after eval rather than between train and eval
as DESIGN.md drew it; `train.py` calls it at the end of a run when `export.formats` is set.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from data.paths import resolve_path
from eval.engine.tau import TauEvaluator
from eval.publish.model_card import render_model_card
from heads.base import atomic_save_dir
from train.checkpoint import head_from_checkpoint, is_checkpoint
from train.rundir import BEST_FILE, CONFIG_FILE, DATA_STATS, kept_head, target_config

log = logging.getLogger(__name__)

CHECK_PROMPTS = "data/corpora/oa_prompts_en/prompts.jsonl"


class ExportCheckError(RuntimeError):
    """The exported folder does not decode like the head it came from."""


@dataclass
class ExportResult:
    out: Path
    format: str
    config: dict
    check: dict = field(default_factory=dict)  # tau of the head and of the re-imported export
    url: str | None = None  # the Hub commit, when pushed


def summary(result: ExportResult) -> str:
    """What the command line prints after an export: the folder, its round trip, the Hub URL."""
    check = result.check
    line = (f"wrote {result.out} ({result.format}); round trip on {check['prompts']} prompts: "
            f"tau {check['tau_export']:.3f} = head {check['tau_head']:.3f}")  # fmt: skip
    return line + (f"\npushed: {result.url}" if result.url else "")


def find_head(source: str | Path) -> tuple[Path, Path | None]:
    """(head folder, run dir or None) for a run dir (best_head, else head), a head folder, or a
    checkpoint folder (its step's weights: train.checkpoint.head_from_checkpoint)."""
    source = Path(resolve_path(source))
    if is_checkpoint(source):  # RUN/checkpoints/step_N: that step's weights, the run's config
        return head_from_checkpoint(source), source.parent.parent
    if (source / "config.json").is_file():
        run = source.parent if (source.parent / CONFIG_FILE).is_file() else None
        return source, run
    head = kept_head(source)
    if head is not None:
        return head, source
    raise FileNotFoundError(
        f"{source}: neither a head folder (config.json) nor a run dir with best_head/ or head/; "
        "give the folder train.py wrote (outputs/<date>/<time>) or a head folder in it."
    )


def run_context(run_dir: Path | None) -> dict:
    """What a run dir says about itself: its config, data size and best checkpoint metric."""
    context: dict = {}
    if run_dir is None:
        return context
    if (run_dir / CONFIG_FILE).is_file():
        context["config"] = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    for name in (DATA_STATS, BEST_FILE):
        if (run_dir / name).is_file():
            context[Path(name).stem] = json.loads((run_dir / name).read_text())
    return context


def check_tree(head) -> int | str:
    """A tree the head can decode: tree16 (depth 4), or a chain as deep as the head drafts."""
    depth = head.max_draft_depth
    return "tree16" if depth is None or depth >= 4 else int(depth)


def round_trip(head, target, imported, imported_target, prompts: int, max_new_tokens: int):
    """Decode the same prompts greedily with both heads (each on its target): the same tokens,
    the same accepted length at every step and so the same tau, or raise ExportCheckError.
    (Greedy output is the target's whatever the draft, so the tokens alone prove little; the
    per-step accept lengths are what a mis-mapped draft changes.)"""
    tree = check_tree(head)
    evaluator = TauEvaluator(CHECK_PROMPTS, limit=prompts, max_new_tokens=max_new_tokens, tree=tree)
    ours = evaluator.decode(head, target)
    theirs = evaluator.decode(imported, imported_target)
    tau_head, tau_export = evaluator.tau_of(ours)["tau"], evaluator.tau_of(theirs)["tau"]
    differ = [
        i for i, (a, b) in enumerate(zip(ours, theirs)) if not torch.equal(a.tokens, b.tokens)
    ]
    if differ or tau_head != tau_export:
        raise ExportCheckError(
            f"the exported draft decodes differently from the head it came from: tau "
            f"{tau_export:.4f} against {tau_head:.4f}, different output on prompts {differ}. "
            "The format's tensor or token mapping is wrong; nothing was written."
        )
    return {
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "tree": str(tree),
        "tau_head": tau_head,
        "tau_export": tau_export,
    }


def export_draft(
    source: str | Path,
    fmt: str,
    out: str | Path,
    *,
    target=None,
    bench: str | Path | None = None,
    check_prompts: int = 4,
    check_tokens: int = 32,
    push: str | None = None,
    private: bool = True,
    overwrite: bool = False,
) -> ExportResult:
    """Export `source` (run dir or head folder) as `fmt` into `out`; see the module doc.

    target: the loaded Target (None: load the one the run was trained on).
    bench: an evaluate.py output dir whose tau/speedup table and plots go into the card.
    """
    import heads
    from heads import interop

    if fmt not in interop.FORMATS:
        raise ValueError(f"--format {fmt!r}: use one of {', '.join(interop.FORMATS)}.")
    head_dir, run_dir = find_head(source)
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists: choose another --out, or pass --overwrite.")
    context = run_context(run_dir)
    loaded = run_target(head_dir, context) if target is None else None
    target = target if target is not None else loaded.target
    head = heads.from_pretrained(head_dir, target).eval()
    # a speculators export names its verifier: the local folder the target loaded from, so that
    # `vllm serve OUT` runs offline; an upload keeps the Hub id, which means something elsewhere
    local = loaded is not None and not push and Path(loaded.source).is_dir()
    verifier = str(Path(loaded.source).resolve()) if local else None
    found: dict = {}

    def write(folder: Path) -> None:  # into a temporary folder, moved to `out` only at the end
        config = interop.export_draft(head, target, fmt, folder, verifier=verifier)
        imported, imported_target = _reimport(folder, fmt, target, head_dir, context)
        check = round_trip(head, target, imported, imported_target, check_prompts, check_tokens)
        summary = _bench_summary(bench)
        plots = _copy_plots(Path(resolve_path(bench)), folder) if summary else []
        card = render_model_card(
            head, target, fmt, config, context, check, summary, repo=push, plots=plots
        )
        (folder / "README.md").write_text(card)
        (folder / "export.json").write_text(json.dumps({"format": fmt, "check": check}, indent=2))
        found.update(config=config, check=check)

    atomic_save_dir(out, write)
    config, check = found["config"], found["check"]
    log.info("exported %s as %s to %s (round trip tau %.3f)", head_dir, fmt, out, check["tau_head"])
    result = ExportResult(out=out, format=fmt, config=config, check=check)
    if push:
        from eval.publish.hub import push_folder

        result.url = push_folder(out, push, private=private)
    return result


def run_target(head_dir: Path, context: dict):
    """The target the head was trained on, read once (a heads.target.RunTarget): the run's model
    config, else the head's record (a Hub id of an embedded target loads the embedded copy)."""
    from heads.folder import read_head_config
    from heads.target import RunTarget

    model = dict(context.get("config", {}).get("model") or {})
    if not model:
        name = read_head_config(head_dir)["target"].get("name_or_path")
        model = {"name_or_path": _embedded_alias(name)}
    return RunTarget.load(target_config(model))


def _embedded_alias(name: str | None) -> str:
    """A head trained on a shipped target records its Hub id; load the shipped copy."""
    from heads.shipped import by_hub_id

    if by_hub_id(name) is not None:
        return by_hub_id(name).alias
    if not name:
        raise ValueError("the head records no target: give the run dir, or --model.")
    return name


def _reimport(folder: Path, fmt: str, target, head_dir: Path, context: dict):
    """(the exported folder loaded back, its target). A native folder of a head that adapts its
    target in place (Medusa-2) is loaded onto a fresh copy of the target."""
    import heads
    from heads import interop

    if fmt == "native":
        fresh = run_target(head_dir, context).target if _adapts_target(head_dir) else target
        return heads.from_pretrained(folder, fresh).eval(), fresh
    return interop.import_draft(folder, target).eval(), target


def _adapts_target(head_dir: Path) -> bool:
    """Whether the head in `head_dir` changes the target it is loaded onto (Medusa-2)."""
    import heads
    from heads.folder import read_head_config

    return heads.head_class(read_head_config(head_dir)["method"]).adapts_target


def _bench_summary(bench: str | Path | None) -> dict | None:
    if bench is None:
        return None
    path = Path(resolve_path(bench)) / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"--bench {bench}: no summary.json there; give an evaluate.py run dir."
        )
    return json.loads(path.read_text())


def _copy_plots(bench_dir: Path, folder: Path) -> list[str]:
    """The benchmark's PNG plots copied into folder/plots/; their names."""
    plots = sorted(bench_dir.glob("*.png"))
    if plots:
        (folder / "plots").mkdir(exist_ok=True)
        for plot in plots:
            shutil.copy2(plot, folder / "plots" / plot.name)
    return [p.name for p in plots]


def export_run(run_dir: str | Path, options) -> list[ExportResult]:
    """train.py's `export` step: every format in options["formats"] from the run's kept head
    into run_dir/export/<format> (on the main process only), pushed when push_to_hub is set."""
    from train.tracking import env_rank

    formats = list(options.get("formats") or [])
    repo = options.get("push_to_hub")
    if repo and len(formats) > 1 and "{format}" not in repo:
        raise ValueError(
            f"export.push_to_hub={repo!r} with {len(formats)} formats: put {{format}} in the repo "
            "name (e.g. me/draft-{format}) so that each format gets its own repo."
        )
    if env_rank() != 0:
        return []
    results = []
    for fmt in formats:
        results.append(
            export_draft(
                run_dir,
                fmt,
                Path(run_dir) / "export" / fmt,
                push=repo.format(format=fmt) if repo else None,
                private=bool(options.get("private", True)),
                check_prompts=int(options.get("check_prompts", 4)),
                check_tokens=int(options.get("check_tokens", 32)),
                overwrite=True,
            )
        )
    return results
