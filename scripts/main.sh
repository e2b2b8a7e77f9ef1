#!/usr/bin/env bash
# Main job on the bundled default: start the tiny MiniMax-M3.1 server (dummy weights) with the
# MXFP4 index-K cache on the CPU, show it answering a /generate request, then stop it.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m sglang_m3.demo --index-k-format mxfp4 "$@"

# Accuracy hook: the short fp8-vs-MXFP4 comparison (accuracy/) runs here.
