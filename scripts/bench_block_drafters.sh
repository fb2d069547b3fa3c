#!/usr/bin/env bash
# One benchmark run of the block drafters against EAGLE-3 and the baselines (issue 14), on the
# embedded SmolLM2: Spec-Bench, the first PER_CATEGORY (default 5) questions of each of its 13
# categories (5: the 80 MT-bench turns and 25 other requests), 48 new tokens, greedy, one
# process, all methods in the same run (about 1 minute per MT-bench question on 2 idle cores).
#   [PER_CATEGORY=3] bash scripts/bench_block_drafters.sh EAGLE3_HEAD DFLASH_HEAD DSPARK_HEAD \
#       [OUT_DIR] [extra overrides]
# Each *_HEAD is a trained head folder (e.g. outputs/<run>/best_head of eagle3_llama,
# dflash_llama, dspark_llama). Writes OUT_DIR/report.md, summary.json, results.jsonl and plots.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
EAGLE3=$1 DFLASH=$2 DSPARK=$3
OUT=${4:-outputs/bench_block_drafters}
shift $(( $# < 4 ? $# : 4 ))
python evaluate.py +experiment=dflash_llama bench=spec_bench bench.per_category=${PER_CATEGORY:-5} \
  bench.max_new_tokens=48 threads=2 methods=[plain,hf_prompt_lookup] \
  "+heads={eagle3_dynamic: {path: $EAGLE3, tree: dynamic}, dflash_chain7: {path: $DFLASH, tree: 7}, dflash_tree16: {path: $DFLASH, tree: tree16}, dspark_chain7: {path: $DSPARK, tree: 7}}" \
  out_dir="$OUT" hydra.run.dir="$OUT" "$@"
