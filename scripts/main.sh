#!/usr/bin/env bash
# Main job on the bundled default: start the tiny MiniMax-M3.1 server (dummy weights) with the
# MXFP4 index-K cache on the CPU, show it answering a /generate request, then stop it.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m sglang_m3.demo --index-k-format mxfp4 "$@"

# Accuracy hook: the short fp8-vs-MXFP4 comparison (accuracy/): one tiny CPU server per format, real
# lm-eval on a few needle and arithmetic samples, paired statistics and a plot in out/main-accuracy.
# Dummy weights answer nothing right: this shows the pipeline, not the accuracy (docs/accuracy.md).
.venv/bin/m3-accuracy --model configs/minimax-m3.1-tiny --formats fp8 mxfp4 \
  --tasks m3_niah_single m3_short_arith --lengths 640 --samples 2 --depths 2 --limit 2 --max-gen-toks 6 \
  --concurrency 2 --bootstrap 1000 --out out/main-accuracy \
  -- --device cpu --attention-backend torch_native --max-total-tokens 4096 --load-format dummy
