"""Build static trees that fit a trained Medusa head, from its measured top-k accuracy.

    python scripts/fit_tree.py RUN_DIR [--nodes 16 32 64] [--out RUN_DIR/trees]

RUN_DIR is a training run dir (config.yaml + head/). The head's per-depth, per-rank accuracy is
measured on the run's validation split and written to accuracy.json beside the trees; each tree
keeps the paths with the highest estimated acceptance. The trees land in RUN_DIR/conf/tree/ as
fit16.yaml etc., so the harness picks one with
    python evaluate.py ... hydra.searchpath=[file://RUN_DIR/conf] tree=fit16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import OmegaConf

import heads
from data.config import DataConfig
from data.prepare import prepare_data
from eval.engine.tree import expected_acceptance_paths
from eval.engine.tree_fit import rank_accuracy
from train.rundir import CONFIG_FILE, HEAD_DIR, load_target_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--max-rank", type=int, default=10)
    parser.add_argument(
        "--against",
        choices=["target", "data"],
        default="target",
        help="label: the target's greedy token (what verification accepts) or the data's",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--head", type=Path, default=None, help="head folder (default RUN_DIR/head)"
    )
    args = parser.parse_args()
    cfg = OmegaConf.load(args.run_dir / CONFIG_FILE)
    target = load_target_config(OmegaConf.to_container(cfg.model, resolve=True))
    head = heads.from_pretrained(args.head or args.run_dir / HEAD_DIR, target).eval()
    # _target_ given here too: a run dir from before data.config.DataConfig has none
    data = prepare_data(instantiate(cfg.data, _target_=DataConfig, _convert_="all"), target)
    accuracy = rank_accuracy(head, target, data.val, args.max_rank, args.against)
    out = args.out or args.run_dir / "conf" / "tree"
    out.mkdir(parents=True, exist_ok=True)
    (out / "accuracy.json").write_text(json.dumps(accuracy, indent=1) + "\n")
    for d, row in enumerate(accuracy):
        print(f"head {d}: " + " ".join(f"{a:.3f}" for a in row[:5]))
    for n in args.nodes:
        paths = expected_acceptance_paths(accuracy, n)
        lines = [f"# {n}-node tree fitted to {args.run_dir} (scripts/fit_tree.py)", "paths:"]
        lines += [f"  - {json.dumps(p)}" for p in paths]
        (out / f"fit{n}.yaml").write_text("\n".join(lines) + "\n")
        print(f"wrote {out / f'fit{n}.yaml'}")


if __name__ == "__main__":
    main()
