#!/usr/bin/env bash
# The checks that need a GPU, as one prepared script (docs/guides/gpu_check.md): bf16 training of every
# head type under DDP (single process on one GPU) and FSDP, DeepSpeed ZeRO-2 when installed, a
# disk feature-cache build and a short speculative-decoding benchmark whose greedy output must
# equal plain greedy. Tiny random targets with a character tokenizer built in-process: no
# downloads, no embedded GGUF. Each step is timed and bounded; about 5-8 minutes on one H200.
#
#   bash scripts/gpu_check.sh                        # on the GPU machine
#   GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh   # reduced dry run on a CPU-only machine
#
# Results: ${OUT:-/tmp}/gpu_check/ (env.json, steps.tsv, summary.md, one folder + log per step).
# Exit status 0 only when no step failed (a skipped step is reported, not failed).
set -uo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate

RES="${OUT:-/tmp}/gpu_check"
DEVICE="${GPU_CHECK_DEVICE:-$(python -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")' 2>/dev/null || echo cpu)}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-540}"
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
rm -rf "$RES" && mkdir -p "$RES"
: >"$RES/steps.tsv"
START=$SECONDS

if [ "$DEVICE" = cpu ]; then  # dry run: prove the steps work, spend little of a shared CPU
    export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
    NGPU=0; PREC=no; STEPS=2; ROWS=24; MAXLEN=512; TIMEOUT=${GPU_CHECK_STEP_TIMEOUT:-150}
    METHODS="medusa eagle eagle3"; FSDP_METHODS="medusa"; BENCH_METHODS="medusa"
    NICE="nice -n 5"; NPROC=1; FSDP_NPROC=2; FSDP_EXPECT=MULTI_CPU
else
    NGPU=$(python -c 'import torch; print(torch.cuda.device_count())')
    PREC=${GPU_CHECK_PRECISION:-bf16}; STEPS=${GPU_CHECK_STEPS:-20}; ROWS=200; MAXLEN=1024
    TIMEOUT=${GPU_CHECK_STEP_TIMEOUT:-150}
    METHODS="medusa eagle eagle3"; FSDP_METHODS="medusa eagle eagle3"
    BENCH_METHODS="medusa eagle eagle3"; NICE=""; NPROC=$NGPU; FSDP_NPROC=$NGPU; FSDP_EXPECT=FSDP
fi
echo "gpu_check: device=$DEVICE gpus=$NGPU precision=$PREC steps=$STEPS results=$RES"

free_port() { python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# step NAME COMMAND...: run bounded by $TIMEOUT (and the overall budget), log, time, record.
step() {
    local name=$1; shift
    local left=$((BUDGET_S - (SECONDS - START)))
    if [ "$left" -lt 20 ]; then
        printf '%s\tSKIP\t0\tout of budget (%ss)\n' "$name" "$BUDGET_S" >>"$RES/steps.tsv"
        echo "[$name] SKIP: out of budget"; return 0
    fi
    local limit=$(( left < TIMEOUT ? left : TIMEOUT )) t0=$SECONDS rc
    echo "[$name] running (limit ${limit}s) ..."
    timeout -k 10 "$limit" $NICE bash -c '"$@"' _ "$@" >"$RES/$name.log" 2>&1
    rc=$?
    local status=PASS note=""
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status=FAIL; note="timed out after ${limit}s"
    elif [ $rc -ne 0 ]; then
        note=$(grep -E '(Error|Exception)\b' "$RES/$name.log" \
            | grep -vE 'CalledProcessError|ChildFailedError|^\s*raise ' | head -1 | cut -c1-240)
        status=FAIL; note="exit $rc: $note"
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" $((SECONDS - t0)) "$note" >>"$RES/steps.tsv"
    echo "[$name] $status in $((SECONDS - t0))s $note"
}
skip() { printf '%s\tSKIP\t0\t%s\n' "$1" "$2" >>"$RES/steps.tsv"; echo "[$1] SKIP: $2"; }

# the tokenizer has 100 tokens: shrink the experiments' 512-token draft / loss vocabularies
head_vocab() { [ "$1" = eagle ] && echo head.loss_vocab_size=64 || echo head.draft_vocab_size=64; }
# train_args NAME METHOD [features] [cache]: the Hydra overrides of one tiny run into $RES/NAME
train_args() {
    echo "$RES/$1" +experiment=$2_tiny model.tokenizer="$RES/tokenizer" "$(head_vocab "$2")" \
        trainer.mixed_precision=$PREC trainer.max_steps=$STEPS trainer.save_every=$STEPS \
        trainer.eval_every=$STEPS trainer.batch_size=4 "evaluators=[]" trainer.best_metric=null \
        data.max_length=$MAXLEN "data.sources.0.max_rows=$ROWS" data.features=${3:-memory} \
        ${4:+data.feature_cache=$4}
}
launch() {  # launch NPROC [accelerate args...] -- NAME METHOD [features] [cache]
    local n=$1; shift; local acc=()
    while [ "$1" != -- ]; do acc+=("$1"); shift; done; shift
    local multi=(); [ "$n" -gt 1 ] && [ ${#acc[@]} -eq 0 ] && multi=(--multi_gpu)
    # shellcheck disable=SC2046
    python -m accelerate.commands.launch "${acc[@]}" "${multi[@]}" --num_processes "$n" \
        --num_machines 1 --mixed_precision $PREC --dynamo_backend no \
        --main_process_port "$(free_port)" scripts/gpu_check.py train $(train_args "$@")
}
train_step() {  # train_step NAME EXPECTED_TYPE NPROC [accelerate args...] -- METHOD [features] [cache]
    local name=$1 expect=$2 n=$3; shift 3; local acc=()
    while [ "$1" != -- ]; do acc+=("$1"); shift; done; shift
    launch "$n" "${acc[@]}" -- "$name" "$@" && python scripts/gpu_check.py check-train "$RES/$name" "$expect"
}

export RES PREC STEPS ROWS MAXLEN
export -f free_port head_vocab train_args launch train_step  # steps run them in a bounded child bash
step env python scripts/gpu_check.py env "$RES"
if grep -q FAIL "$RES/steps.tsv"; then
    echo "gpu_check: a package every step needs is missing (see $RES/env.log); stopping."
    python scripts/gpu_check.py summary "$RES"; exit 1
fi
if [ "$DEVICE" != cpu ] && [ "$NGPU" -lt 1 ]; then
    echo "gpu_check: GPU_CHECK_DEVICE=$DEVICE but torch sees no GPU; stopping."; exit 1
fi
step tokenizer python scripts/gpu_check.py tokenizer "$RES/tokenizer"

# 1. every head type, data parallel (one process per GPU; one process alone on one GPU / CPU)
DDP_EXPECT=$([ "$NPROC" -gt 1 ] && echo MULTI_GPU || echo NO)
for m in $METHODS; do
    step "ddp_$m" train_step "ddp_$m" "$DDP_EXPECT" $((NPROC > 0 ? NPROC : 1)) -- "$m"
done

# 2. FSDP (conf/accelerate/fsdp.yaml). On CPU Accelerate quietly runs it as DDP over gloo (it
#    enables FSDP only for GPU-like devices), so the dry run expects MULTI_CPU.
for m in $FSDP_METHODS; do
    step "fsdp_$m" train_step "fsdp_$m" "$FSDP_EXPECT" "$FSDP_NPROC" \
        --config_file conf/accelerate/fsdp.yaml -- "$m"
done

# 3. DeepSpeed ZeRO-2 (conf/accelerate/deepspeed_zero2.yaml), only where it is installed
if [ "$DEVICE" = cpu ]; then
    skip deepspeed_medusa "DeepSpeed needs a GPU"
elif ! python -c 'import deepspeed' >/dev/null 2>&1; then
    skip deepspeed_medusa "deepspeed is not installed (pip install deepspeed; no internet here)"
else
    step deepspeed_medusa train_step deepspeed_medusa DEEPSPEED "$NGPU" \
        --config_file conf/accelerate/deepspeed_zero2.yaml -- medusa
fi

# 4. disk feature cache: build it (sharded, on the target's device), then train from it
step feature_cache train_step feature_cache "$DDP_EXPECT" $((NPROC > 0 ? NPROC : 1)) -- \
    eagle3 disk "$RES/features"
if [ -f "$RES/features/train/index.json" ]; then
    echo "[feature_cache] $(du -sh "$RES/features" | cut -f1) on disk"
else
    printf 'feature_cache_index\tFAIL\t0\tno %s\n' "$RES/features/train/index.json" >>"$RES/steps.tsv"
fi

# 5. benchmark: tree speculative decoding with each trained head; greedy output == plain greedy
for m in $BENCH_METHODS; do
    if [ ! -f "$RES/ddp_$m/head/model.safetensors" ]; then skip "bench_$m" "no trained head"; continue; fi
    step "bench_$m" bash -c "python evaluate.py +experiment=${m}_tiny model.tokenizer='$RES/tokenizer' \
        $(head_vocab "$m") head_path='$RES/ddp_$m/head' bench.limit=2 \
        bench.max_new_tokens=$([ "$DEVICE" = cpu ] && echo 16 || echo 64) \
        'methods=[plain,hf_generate,head]' tree=chain 'tree.paths=[[0],[0,0]]' \
        hydra.run.dir='$RES/bench_$m' && python scripts/gpu_check.py check-bench '$RES/bench_$m'"
done

echo "gpu_check: done in $((SECONDS - START))s; results in $RES"
python scripts/gpu_check.py summary "$RES"
