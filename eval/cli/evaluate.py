"""Benchmark a trained draft head against plain decoding and HF generate, in one run.

    draftsmith-evaluate +experiment=medusa_llama head_path=DIR bench=mt_bench bench.limit=8
    draftsmith-evaluate bench=jsonl bench.path=prompts.jsonl head_path=null   # baselines only

The same command as the root `python evaluate.py` (which calls this `main`), from any folder;
`python -m eval.cli.evaluate` works too. Writes results.jsonl, summary.json, report.md and PNG
plots into the Hydra run dir (conf/evaluate.yaml; eval/bench/harness.py does the work). A bad
setting or a bad head folder prints one line with the fix (exit status 2; HYDRA_FULL_ERROR=1
shows the traceback).
"""

import re
import sys

import hydra
from omegaconf import DictConfig

from data.paths import CONF_DIR
from train.cli import report_user_errors

_CHAIN = re.compile(r"^tree=(\d+)$")


def chain_overrides(argv: list[str]) -> list[str]:
    """`tree=N` (a chain of N drafted tokens, what block drafters use) as Hydra overrides: the
    `tree` config group takes names only, so it becomes `tree=chain` with N single-child paths."""
    out = []
    for arg in argv:
        found = _CHAIN.match(arg)
        if found and int(found.group(1)) >= 1:
            n = int(found.group(1))
            paths = ",".join("[" + ",".join(["0"] * d) + "]" for d in range(1, n + 1))
            out += ["tree=chain", f"tree.paths=[{paths}]"]
        else:
            out.append(arg)
    return out


# Hydra names the job after this module (`evaluate`): the run dir's log is evaluate.log.
@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="evaluate")
@report_user_errors
def evaluate(cfg: DictConfig) -> None:
    from eval.bench.harness import run

    run(cfg)


def main() -> None:
    """The console script: `tree=N` arguments rewritten, then Hydra."""
    sys.argv[1:] = chain_overrides(sys.argv[1:])
    evaluate()


if __name__ == "__main__":
    main()
