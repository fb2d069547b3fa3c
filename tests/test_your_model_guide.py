"""docs/guides/your_model.md, walked as a user would: its train, evaluate and export commands,
read from the guide itself, run through the real command line on tiny random models of three
families (Llama, Qwen2, Gemma-3), each saved as a Hugging Face folder, and on a GGUF file.

Each command gets overrides appended that make it take seconds (two steps, four prompts, a few
tokens, the HF backend for answers); the guide's part of the command is run as written, with
MODEL and outputs/RUN filled in. Typos in the model's path are one line each."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import save_tiny_hf_model

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "guides" / "your_model.md"
FAST_TRAIN = [
    "trainer.max_steps=2",
    "trainer.time_budget_min=0",
    "trainer.eval_every=0",
    "trainer.save_every=0",
    "trainer.warmup_steps=1",
    "trainer.best_metric=null",
    "trainer.mixed_precision=no",
    "evaluators=[]",
    "head.draft_vocab_size=512",
    "data.features=memory",
    "data.max_length=128",
    "data.max_val_examples=2",
    "data.self_distill.backend=hf",
    "data.self_distill.max_new_tokens=8",
    "data.self_distill.batch_size=4",
    "data.self_distill.prompts=[{path: data/corpora/oa_prompts_en/prompts.jsonl, skip: 16, "
    "max_rows: 6}]",
    "logger.mode=disabled",
]
FAST_EVAL = ["bench.limit=1", "bench.max_new_tokens=6", "bench.warmup=0"]
pytestmark = pytest.mark.integration


def guide_commands(prefix: str) -> list[str]:
    """The guide's commands (in its bash blocks) that start with `prefix`, in order."""
    blocks = re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.startswith(prefix)]


def tiny_model(folder: Path, family: str) -> Path:
    """A random 2-layer model of `family` with SmolLM2's tokenizer, saved as a HF folder."""
    extra = {"head_dim": 16} if family == "gemma3_text" else {}
    return save_tiny_hf_model(folder, family, max_position_embeddings=1024, **extra)


def run(command: str, model: Path, run_dir: Path, extra: list[str], cwd: Path = REPO):
    """One guide command, MODEL and outputs/RUN filled in, with `extra` overrides appended."""
    text = command.replace("outputs/RUN", str(run_dir)).replace("MODEL", str(model))
    args = shlex.split(text)
    assert args[0] == "python"
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "HYDRA_FULL_ERROR": "0",
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, *args[1:], *extra], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, f"{text}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text"])
def test_the_guide_trains_and_evaluates_a_model_of_each_family(family, tmp_path):
    model = tiny_model(tmp_path / family, family)
    train, evaluate = guide_commands("python train.py"), guide_commands("python evaluate.py")
    assert len(train) >= 2 and evaluate
    for i, command in enumerate(train):  # the plain template, then the model's own
        run_dir = tmp_path / f"run{i}"
        out = run(command, model, run_dir, [f"hydra.run.dir={run_dir}", *FAST_TRAIN])
        assert (run_dir / "head" / "config.json").is_file()
        assert "training tokens/s" in out.stdout
    plain = (tmp_path / "run0" / "config.yaml").read_text()
    assert "Assistant:" in plain  # the plain template travels with the run's config
    for i in (0, 1):  # run0's plain template comes from its run, as the guide says
        eval_dir = tmp_path / f"eval{i}"
        run(evaluate[0], model, tmp_path / f"run{i}", [f"hydra.run.dir={eval_dir}", *FAST_EVAL])
        summary = json.loads((eval_dir / "summary.json").read_text())
        for method in ("plain", "head"):
            assert summary["methods"][method]["overall"]["greedy_mismatches"] == 0


def test_a_gguf_file_is_a_target_from_training_to_llama_cpp(tmp_path):
    """A .gguf file as model.name_or_path: de-quantized once, trained on, evaluated, exported
    to GGUF and served beside itself in llama-server, as the guide's last steps do."""
    from data.engines import llama_cpp
    from heads.interop.gguf import target_gguf

    if not llama_cpp.available():  # a failure, not a skip: set-up builds it
        pytest.fail("llama.cpp is not built here: run bash scripts/setup_llama_cpp.sh")
    folder = tiny_model(tmp_path / "hf", "llama")
    gguf = target_gguf(folder, tmp_path / "gguf" / "tiny-llama.F32.gguf", "f32")
    cache = {"DRAFTSMITH_CACHE": str(tmp_path / "cache")}
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "llama.cpp").symlink_to(llama_cpp.llama_cpp_home().parent)
    os.environ.update(cache)
    try:
        run_dir = tmp_path / "run"
        run(guide_commands("python train.py")[1], gguf, run_dir,
            [f"hydra.run.dir={run_dir}", *FAST_TRAIN])  # fmt: skip
        assert list((tmp_path / "cache" / "targets" / "gguf").iterdir())  # converted once
        export = guide_commands("python scripts/export.py")[0]
        out = tmp_path / "exports"
        run(export.replace("exports/gguf", str(out)), gguf, run_dir, [])
        assert list(out.glob("draft-*.gguf"))
        serve = guide_commands("python evaluate.py")[-1]
        eval_dir = tmp_path / "eval"
        run(serve, gguf, run_dir, [f"hydra.run.dir={eval_dir}", *FAST_EVAL, "llama_cpp.threads=1"])
        assert "llama_cpp_draft" in (eval_dir / "summary.json").read_text()
    finally:
        for key in cache:
            os.environ.pop(key, None)


@pytest.mark.parametrize(
    "override, says",
    [
        ("model.name_or_path=/no/such/model", "model.name_or_path=/no/such/model: no such file"),
        ("model.name_or_path=./typo/model.gguf", "no such GGUF file"),
        ("model.gguf_file=nothing.gguf", "model.gguf_file=nothing.gguf: not a file"),
    ],
)
def test_a_wrong_model_path_is_one_line_through_the_real_cli(override, says, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HYDRA_FULL_ERROR": "0"}
    args = [sys.executable, "train.py", "+experiment=eagle3_llama", override,
            f"hydra.run.dir={tmp_path}"]  # fmt: skip
    if override.startswith("model.gguf_file"):
        args.append(f"model.name_or_path={tiny_model(tmp_path / 'm', 'llama')}")
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert says in lines[0] and "Traceback" not in done.stderr
