#!/usr/bin/env bash
# Main job on the bundled default: serve the small MSA model trained here (configs/msa-small, real weights)
# with the MXFP4 index-K cache on the CPU, ask it one needle question it has never seen in an 8k-token
# context, print the answer, whether it is right and the blocks each index head picked against the needle's
# block, then the pool capacity per index-K format. `--model configs/minimax-m3.1-tiny` serves the tiny
# config with dummy weights instead (gibberish answers, by construction).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python examples/needle_demo.py --index-k-format mxfp4 "$@"

# Accuracy hook: the fp8-vs-MXFP4 comparison (accuracy/) on the small MSA model trained here
# (configs/msa-small, real weights): one CPU server per format, real lm-eval on single-needle prompts
# of 4096 tokens (32 blocks, so top-16 selection drops half of them), paired statistics and a plot in
# out/main-accuracy (report.md, results.json, accuracy_vs_length.png, samples/, server logs). With 4
# prompts and no discordant pair the interval of MXFP4 - fp8 is +-49 points: this checks the pipeline,
# not the format. The full comparison (dense control, bf16, 4k-32k) is in docs/accuracy.md.
.venv/bin/m3-accuracy --model configs/msa-small --formats fp8 mxfp4 \
  --tasks m3_niah_single --lengths 4096 --samples 4 --depths 4 --concurrency 1 \
  --out out/main-accuracy -- --device cpu --attention-backend torch_native --max-total-tokens 8192 \
  --context-length 8192
