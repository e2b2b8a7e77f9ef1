#!/usr/bin/env bash
# One H200 call of the medium MSA model's training (lab/training/configs/msa-medium.json): resume if asked,
# train until a time budget, export the SGLang checkpoint, probe retrieval (training.retrieval_probe),
# and leave at most 8 files in $OUT.
#
#   lab/gpu/train_msa_medium_h200.sh                        # call 1: a new run with the plan below
#   RESUME=build/msa-medium lab/gpu/train_msa_medium_h200.sh   # next call, same machine still held: exact
#   RESUME=<dir holding portable.pt.part-*> lab/gpu/train_msa_medium_h200.sh   # from a returned state
#
# Run it from the repo root with a 600 s limit; it takes BUDGET_S (default 540) seconds wall. Split of the
# budget: setup, training (the trainer stops stepping RESERVE_S before its share ends, then checkpoints and
# exports), the probe (PROBE_S), packing (about 15 s). The trainer runs under a hard timeout, so a hung or
# crashed trainer still leaves its last checkpoint (every CKPT_EVERY_S seconds), which is then exported.
#
# $RUN_DIR (default build/msa-medium, git-ignored; it survives between calls only while the machine is held)
# keeps ckpt/state.pt (exact: weights and Adam state in fp32, ~57 MiB), portable.pt, train.log,
# metrics.jsonl, export/ and the inductor cache (flex-attention kernels compiled once per length).
# $OUT (default out/msa-medium) gets:
#   call.log                        everything this call printed (the trainer's log lines included)
#   metrics.jsonl                   the run's metrics so far (last 15 MiB)
#   probe/probe.md, probe/probe.json  retrieval per task x length x mode, Wilson 95% intervals, per sample
#   export.tgz                      the SGLang checkpoint (bf16, ~9.5 MiB): `tar -xzf export.tgz` gives export/
#   portable.pt.part-aa, -ab, ...   the portable resume state in 15 MiB parts (PORTABLE_MOMENTS=second:
#                                   fp32 weights + bf16 second moments, ~28 MiB; `both` ~38 MiB)
# For lab/data/, keep call.log as train_msa_medium_h200_<date>_call<N>.log and probe.md/json likewise.
#
# Env: BUDGET_S (540), PROBE_S (100), RESERVE_S (45), CKPT_EVERY_S (120), RUN_DIR, OUT, RESUME, FRESH=1
# (start over although $RUN_DIR holds a checkpoint), PORTABLE_MOMENTS (second | both | none), PROBE_ARGS
# (extra training.retrieval_probe arguments), PYTHON (python3), DEVICE (cuda; cpu for the smoke test).
# Arguments after the script name go to training.train: plan arguments for a new run (they replace the
# plan below only where given), call arguments (--eval-every, ...) for any run.
set -uo pipefail
cd "$(dirname "$0")/../.."
t0=$(date +%s)
OUT="${OUT:-out/msa-medium}"
RUN_DIR="${RUN_DIR:-build/msa-medium}"
BUDGET_S="${BUDGET_S:-540}"
PROBE_S="${PROBE_S:-100}"
# Per call: fp8 and mxfp4 selection, up to 16 prompts per (task, length) in rounds of 4 (a 128k forward
# is estimated at about a second per mode, not yet measured: 100 s would give each cell about 8); the
# last call of a plan can give the probe more (PROBE_S=300 PROBE_ARGS="--modes dense,fp8,mxfp4 --samples 32").
PROBE_ARGS="${PROBE_ARGS:---modes fp8,mxfp4 --samples 16 --round 4}"
RESERVE_S="${RESERVE_S:-45}"
CKPT_EVERY_S="${CKPT_EVERY_S:-120}"
PORTABLE_MOMENTS="${PORTABLE_MOMENTS:-second}"
PYTHON="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
mkdir -p "$OUT" "$RUN_DIR"
exec > >(tee -a "$OUT/call.log") 2>&1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_CACHE_DIR="$PWD/$RUN_DIR/inductor"
elapsed() { echo $(( $(date +%s) - t0 )); }

# The plan of a new run: 30 minutes of trained seconds (about 4-5 calls); lengths 512-2048 first (top-16
# keeps every block there, retrieval must emerge), then 4k-16k, then 8k-128k from 55% of the plan; dense
# with the indexer's KL warm-up until 70%, sparse after; 128k tokens per step (one 128k sequence, or 256
# of 512). Stages and phases are fractions of the plan (steps is only a cap in a time plan).
PLAN=(--config lab/training/configs/msa-medium.json --train-s 1800 --steps 100000 --dense-steps 70000
      --curriculum "0:512,1024,2048;0.3:4096,8192,16384;0.55:8192,32768,65536,131072"
      --token-budget 131072 --task-weights single=0.1,multikey=0.3,kv=0.3,vt=0.15,copy=0.15 --lr 2e-3)

if [ -n "${RESUME:-}" ]; then
    start=(--resume "$RESUME")
elif [ -f "$RUN_DIR/ckpt/state.pt" ] && [ -z "${FRESH:-}" ]; then
    echo "error: $RUN_DIR holds a checkpoint; set RESUME=$RUN_DIR to continue it or FRESH=1 to start over"
    exit 2
else
    rm -rf "$RUN_DIR/ckpt" "$RUN_DIR/export" "$RUN_DIR/portable.pt" "$RUN_DIR/train.log" "$RUN_DIR/metrics.jsonl"
    start=("${PLAN[@]}")
fi

if ! "$PYTHON" -c "import torch, tokenizers, safetensors, scipy" 2>/dev/null; then
    echo "torch/tokenizers/safetensors/scipy missing: using the carried bundle"
    source lab/gpu/bundle_env.sh || exit 1
fi
export PYTHONPATH="$PWD:$PWD/kernels:$PWD/lab${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$PYTHON" -c "import torch, tokenizers, safetensors; print('torch', torch.__version__, 'tokenizers', \
tokenizers.__version__, 'safetensors', safetensors.__version__, 'cuda', torch.cuda.is_available())" || exit 1
echo "train_msa_medium_h200: start $(date -u +%FT%TZ), resume=${RESUME:-none}, budget ${BUDGET_S}s"

train_s=$(( BUDGET_S - $(elapsed) - PROBE_S - 20 ))
if [ "$train_s" -lt 30 ]; then
    echo "error: BUDGET_S=$BUDGET_S leaves ${train_s}s for training after the probe's ${PROBE_S}s"
    exit 2
fi
timeout --signal=TERM --kill-after=10 "$train_s" "$PYTHON" -m training.train --out "$RUN_DIR" \
    --budget-s "$(( train_s - 5 ))" --reserve-s "$RESERVE_S" --ckpt-every-s "$CKPT_EVERY_S" \
    --portable --portable-moments "$PORTABLE_MOMENTS" --tf32 --device "$DEVICE" --no-final-eval \
    --eval-every 1000 --eval-lengths 8192,32768 --eval-samples 2 "${start[@]}" "$@"
rc=$?
echo "trainer exit $rc after $(elapsed)s"
if [ "$rc" -ne 0 ] && [ -f "$RUN_DIR/ckpt/state.pt" ]; then
    echo "trainer did not finish: exporting its last checkpoint"
    "$PYTHON" -m training.export "$RUN_DIR/ckpt/state.pt" "$RUN_DIR/export" || echo "export failed"
fi

if [ -f "$RUN_DIR/export/config.json" ]; then
    probe_s=$(( BUDGET_S - $(elapsed) - 15 ))
    # shellcheck disable=SC2086
    timeout --signal=TERM --kill-after=5 "$(( probe_s > 10 ? probe_s : 10 ))" "$PYTHON" -m training.retrieval_probe \
        "$RUN_DIR/export" --budget-s "$(( probe_s > 20 ? probe_s - 10 : 10 ))" --device "$DEVICE" \
        --out "$OUT/probe" $PROBE_ARGS || echo "probe failed or timed out"
    tar -C "$RUN_DIR" -czf "$OUT/export.tgz" export
fi
if [ -f "$RUN_DIR/metrics.jsonl" ]; then
    tail -c 15728640 "$RUN_DIR/metrics.jsonl" > "$OUT/metrics.jsonl"
fi
if [ -f "$RUN_DIR/portable.pt" ]; then
    split -b 15m "$RUN_DIR/portable.pt" "$OUT/portable.pt.part-"
fi
ls -l "$OUT" "$OUT/probe" 2>/dev/null
n=$(find "$OUT" -type f | wc -l)
echo "train_msa_medium_h200: exit $rc after $(elapsed)s; $n files in \$OUT (at most 8 come back)"
exit "$rc"
