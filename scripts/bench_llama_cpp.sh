#!/usr/bin/env bash
# The llama.cpp measurements of issue 12 on 2 CPU cores, one after another (never in parallel:
# timings are ratios within one run). Usage: bash scripts/bench_llama_cpp.sh RUN_DIR OUT_DIR
#   RUN_DIR: an eagle3_llama run (its best_head is exported to GGUF on the fly)
# Writes OUT_DIR/{distill.json, q4_1/, f32/, bf16/} (evaluate.py reports) and logs; a step
# whose output exists is skipped (rerun after an interruption).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
RUN=$1; OUT=$2; mkdir -p "$OUT"
HEAD="$RUN/best_head"; [ -d "$HEAD" ] || HEAD="$RUN/head"
CHAIN='tree.paths=[[0],[0,0],[0,0,0]]'
MT='bench=mt_bench bench.per_category=5 bench.max_new_tokens=64'  # 40 questions = 80 turns
common="+experiment=eagle3_llama head_path=$HEAD threads=2 llama_cpp.threads=2 llama_cpp.draft_n_max=3"
# 1. data generation: HF generate (batch 8) vs llama-server (1 and 8 slots), same 32 prompts
[ -f "$OUT/distill.json" ] || python scripts/bench_distill.py --batch-sizes 8 \
  --llama-cpp-slots 1 8 --prompts 32 --max-new-tokens 128 --threads 2 --out "$OUT/distill.json" \
  2>&1 | tee "$OUT/distill.log"
# 2. the embedded Q4_1 target: HF reference, the harness's chain of 3, llama.cpp plain/draft/ngram
[ -f "$OUT/q4_1/summary.json" ] || python evaluate.py $common $MT "$CHAIN" out_dir="$OUT/q4_1" \
  methods=[hf_generate,head,llama_cpp_plain,llama_cpp_draft,llama_cpp_ngram] 2>&1 | tail -5
# 3. an f32 GGUF of the same weights: llama.cpp acceptance vs the harness's (parity)
[ -f "$OUT/f32/summary.json" ] || python evaluate.py $common bench=mt_bench \
  bench.per_category=1 bench.max_new_tokens=64 "$CHAIN" out_dir="$OUT/f32" \
  llama_cpp.target_gguf=f32 methods=[head,llama_cpp_plain,llama_cpp_draft] 2>&1 | tail -5
# 4. the HF harness in bf16: divergences of a batched verify from one-token steps
[ -f "$OUT/bf16/summary.json" ] || python evaluate.py $common bench=mt_bench \
  bench.per_category=1 bench.max_new_tokens=64 "$CHAIN" out_dir="$OUT/bf16" \
  model.dtype=bfloat16 methods=[hf_generate,plain,head] 2>&1 | tail -5
echo "done: $OUT"
