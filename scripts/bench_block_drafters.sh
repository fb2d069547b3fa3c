#!/usr/bin/env bash
# One benchmark run of the block drafters against EAGLE-3 and the baselines (issue 14), on the
# embedded SmolLM2: Spec-Bench, the first PER_CATEGORY (default 5) questions of each category
# (5: the 80 MT-bench turns and 25 other requests), 48 new tokens, greedy, one process, every
# method in the same run, turn by turn:
#   plain, HF prompt lookup; EAGLE-3 on its dynamic tree; DFlash on a 16-node tree from its
#   slots' ranks; DSpark on a chain of its 7 drafts; and llama.cpp (the embedded Q4_1 GGUF)
#   plain, with the DSpark draft as a GGUF (--spec-type draft-dspark, 7 drafts a step) and with
#   its n-gram drafter.
#   [PER_CATEGORY=5] bash scripts/bench_block_drafters.sh EAGLE3_HEAD DFLASH_HEAD DSPARK_HEAD \
#       [OUT_DIR] [extra overrides, e.g. '+heads.eagle3_b={path: DIR, tree: dynamic}']
# Each *_HEAD is a trained head folder or checkpoint (e.g. outputs/<run>/best_head of
# eagle3_llama_long, dflash_llama_long, dspark_llama_long, or outputs/<run>/checkpoints/step_N).
# Writes OUT_DIR/report.md, summary.json, results.jsonl and plots.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
EAGLE3=$1 DFLASH=$2 DSPARK=$3
OUT=${4:-outputs/bench_block_drafters}
shift $(( $# < 4 ? $# : 4 ))
python evaluate.py +experiment=dspark_llama_long bench=spec_bench \
  bench.per_category=${PER_CATEGORY:-5} bench.max_new_tokens=48 threads=${THREADS:-2} \
  llama_cpp.threads=${THREADS:-2} tree=7 head_path="$DSPARK" llama_cpp.draft_n_max=7 \
  methods=[plain,hf_prompt_lookup,llama_cpp_plain,llama_cpp_draft,llama_cpp_ngram] \
  "+heads={eagle3_dynamic: {path: $EAGLE3, tree: dynamic}, dflash_tree16: {path: $DFLASH, tree: tree16}, dspark_chain7: {path: $DSPARK, tree: 7}}" \
  logger.mode=disabled out_dir="$OUT" hydra.run.dir="$OUT" "$@"
