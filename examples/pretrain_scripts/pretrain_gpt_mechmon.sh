#!/usr/bin/env bash
# Megatron-LM pretrain_gpt.py with the mechmon monitors, single node (torchrun).
#
#   MEGATRON_LM_DIR=/path/to/Megatron-LM bash examples/pretrain_scripts/pretrain_gpt_mechmon.sh [extra args]
#
# MECHMON_LAUNCH chooses how mechmon attaches:
#   run   (default) the checkout stays unmodified: torchrun starts
#         `-m mechmon_megatron.adapters.megatron_lm.run pretrain_gpt.py ...` (mechmon-run), which
#         installs the hooks and the --mechmon* flags and validates them at argument parsing.
#   patch the checkout must carry the mechmon patch (`mechmon-patch apply $MEGATRON_LM_DIR`; the
#         script checks) and torchrun starts pretrain_gpt.py itself.
# Defaults: a tiny GPT-MoE on --mock-data, checks every 10 iterations; override with the
# variables below or append any Megatron-LM / --mechmon-* flag (later flags win).
# Without a GPU it runs on CPU (tests and laptops only): --transformer-impl local
# --distributed-backend gloo, started through `-m mechmon_megatron.testing.megatron_lm_cpu
# --launch $MECHMON_LAUNCH`, which makes Megatron-LM run on CPU (and is mechmon-run for `run`).
#
# Exit status: Megatron's, except after a mechmon checkpoint-and-abort, which exits with
# MECHMON_EXIT_CODE (torchrun itself reports any failing worker as 1; the script recognises the
# abort by the fresh mechmon_alert.json in the latest checkpoint). A bad --mechmon* flag: every
# worker exits 2 at argument parsing, before any process group or model exists.
set -euo pipefail

: "${MEGATRON_LM_DIR:?set MEGATRON_LM_DIR to the Megatron-LM checkout}"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MECHMON_DIR="${MECHMON_DIR:-$(cd "$SCRIPT_DIR/../.." && pwd)}"
RUN_DIR="${RUN_DIR:-$PWD/runs/gpt_mechmon}"
NPROC_PER_NODE="${NPROC_PER_NODE:-}"
TRAIN_ITERS="${TRAIN_ITERS:-100}"
MECHMON_INTERVAL="${MECHMON_INTERVAL:-10}"
MECHMON_DELTA="${MECHMON_DELTA:-10}"
MECHMON_ACTION="${MECHMON_ACTION:-checkpoint-and-abort}"
MECHMON_EXIT_CODE="${MECHMON_EXIT_CODE:-42}"
MASTER_PORT="${MASTER_PORT:-29511}"
NNODES="${NNODES:-1}"            # multi-node (the sbatch script): also set RDZV_ENDPOINT=host:port
RDZV_ENDPOINT="${RDZV_ENDPOINT:-}"
RDZV_ID="${RDZV_ID:-mechmon}"
MECHMON_LAUNCH="${MECHMON_LAUNCH:-run}"
case "$MECHMON_LAUNCH" in
    run|patch) ;;
    *) echo "pretrain_gpt_mechmon.sh: MECHMON_LAUNCH must be run or patch, got '$MECHMON_LAUNCH'" >&2; exit 2 ;;
esac

PYTHON="${PYTHON:-python}"
export PYTHONPATH="$MEGATRON_LM_DIR:$MECHMON_DIR${PYTHONPATH:+:$PYTHONPATH}"
if [ "$MECHMON_LAUNCH" = patch ]; then
    "$PYTHON" "$MECHMON_DIR/tools/mechmon_patch.py" status "$MEGATRON_LM_DIR" >/dev/null || {
        echo "pretrain_gpt_mechmon.sh: MECHMON_LAUNCH=patch but $MEGATRON_LM_DIR/pretrain_gpt.py lacks the mechmon" \
             "patch; run: python $MECHMON_DIR/tools/mechmon_patch.py apply $MEGATRON_LM_DIR (or use MECHMON_LAUNCH=run)" >&2
        exit 2
    }
fi

if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    NPROC_PER_NODE="${NPROC_PER_NODE:-$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')}"
    DEVICE_ARGS=(--bf16)
    if [ "$MECHMON_LAUNCH" = run ]; then
        ENTRY=(-m mechmon_megatron.adapters.megatron_lm.run pretrain_gpt.py)
    else
        ENTRY=(pretrain_gpt.py)
    fi
else
    NPROC_PER_NODE="${NPROC_PER_NODE:-2}"
    export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    ENTRY=(-m mechmon_megatron.testing.megatron_lm_cpu --launch "$MECHMON_LAUNCH" pretrain_gpt.py)
    DEVICE_ARGS=(--transformer-impl local --distributed-backend gloo --no-gradient-accumulation-fusion
                 --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion
                 --no-rope-fusion --no-persist-layer-norm)
fi

MODEL_ARGS=(--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
            --seq-length 64 --max-position-embeddings 64 --position-embedding-type rope
            --normalization RMSNorm --disable-bias-linear
            --num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type allgather)
TRAIN_ARGS=(--micro-batch-size 2 --global-batch-size $((2 * NPROC_PER_NODE * NNODES)) --train-iters "$TRAIN_ITERS"
            --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine
            --mock-data --tokenizer-type NullTokenizer --vocab-size 256 --split 99,1,0
            --eval-iters 0 --eval-interval 1000000)
OUTPUT_ARGS=(--save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 50
             --tensorboard-dir "$RUN_DIR/tensorboard" --log-interval 10)
MECHMON_ARGS=(--mechmon --mechmon-interval "$MECHMON_INTERVAL" --mechmon-delta "$MECHMON_DELTA"
              --mechmon-action "$MECHMON_ACTION" --mechmon-exit-code "$MECHMON_EXIT_CODE")

mkdir -p "$RUN_DIR"
STARTED="$RUN_DIR/.started"
touch "$STARTED"
cd "$MEGATRON_LM_DIR"
if [ -n "$RDZV_ENDPOINT" ]; then
    LAUNCH=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID")
else
    LAUNCH=(--nnodes 1 --master-addr 127.0.0.1 --master-port "$MASTER_PORT")
fi
set +e
torchrun "${LAUNCH[@]}" --nproc-per-node "$NPROC_PER_NODE" \
    "${ENTRY[@]}" "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${DEVICE_ARGS[@]}" \
    "${MECHMON_ARGS[@]}" "$@" &
TORCHRUN_PID=$!
# SIGTERM/SIGINT (Slurm time-limit warning, preemption): hand it to the workers themselves, so
# Megatron's --exit-signal-handler saves a checkpoint and exits 0 (torchrun would kill them).
trap 'pkill -TERM -P "$TORCHRUN_PID" 2>/dev/null || true' TERM INT
STATUS=0
wait "$TORCHRUN_PID" || STATUS=$?
while kill -0 "$TORCHRUN_PID" 2>/dev/null; do  # wait was interrupted by the trap
    STATUS=0
    wait "$TORCHRUN_PID" || STATUS=$?
done
trap - TERM INT
set -e

# A mechmon abort leaves mechmon_alert.json in the checkpoint it just saved.
TRACKER="$RUN_DIR/checkpoints/latest_checkpointed_iteration.txt"
if [ "$STATUS" -ne 0 ] && [ -f "$TRACKER" ]; then
    ALERT="$(printf '%s/checkpoints/iter_%07d/mechmon_alert.json' "$RUN_DIR" "$(cat "$TRACKER")")"
    if [ -f "$ALERT" ] && [ "$ALERT" -nt "$STARTED" ]; then
        echo "pretrain_gpt_mechmon.sh: mechmon checkpoint-and-abort, see $ALERT" >&2
        exit "$MECHMON_EXIT_CODE"
    fi
fi
exit "$STATUS"
