#!/usr/bin/env bash
# Train the micro MSA config (lab/training/configs/msa-micro.json: hidden 128, 2 layers, layer 1 sparse,
# 4 q / 2 KV heads x 64) on the CPU at T=512 with the retrieval recipe (several questions per sample,
# half asked twice, loss on the question rows), then probe it (training.probe): per-digit answer
# accuracy (chance 0.1) for first and repeated questions, and the loss on the asked key's words
# (chance ln 40 = 3.69 nats in kv, ln 16 = 2.77 in multikey; below it = keys copied from the context).
#
#   lab/scripts/train_micro_cpu.sh [STEPS] [extra train.py args]     # default 600 steps, ~10-20 min on 2 cores
#
# Env: OUT (default build/msa-micro), CONFIG (default lab/training/configs/msa-micro.json).
# What it showed (docs/accuracy.md, "Training the small MSA model"): key copying emerges within
# ~250 steps; digit retrieval stayed at chance through 600 steps.
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS="${1:-600}"
shift || true
OUT="${OUT:-build/msa-micro}"
CONFIG="${CONFIG:-lab/training/configs/msa-micro.json}"
export PYTHONPATH="$PWD:$PWD/kernels:$PWD/lab${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
rm -rf "$OUT"
"$PY" -m training.train --config "$CONFIG" --out "$OUT" --device cpu --steps "$STEPS" --dense-steps "$STEPS" \
    --short-steps "$STEPS" --short-lengths 512 --long-lengths 512 --token-budget 4096 --lr 3e-3 --warmup-steps 20 \
    --queries 8 --query-weight 1.0 --task-weights single=0,multikey=0.35,kv=0.35,vt=0,copy=0.3 --lm-rows 32 --kl-rows 32 \
    --eval-samples 0 --no-export --log-every 20 --budget-s 100000 --reserve-s 0 --prefetch 2 "$@"
"$PY" -m training.probe "$OUT" --length 512 --samples 48
