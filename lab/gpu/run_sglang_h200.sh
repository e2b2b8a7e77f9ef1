#!/usr/bin/env bash
# SGLang 0.5.16 + sglang-m3 on an H200: CUDA-graph decode with bf16, fp8 and MXFP4 index-K caches.
#
# Runs on the GPU machine from the repo root, with the bundle made by
# lab/gpu/build_wheel_bundle.sh in .whl1/ (.whl2/, ... if it was split); lab/gpu/bundle_env.sh
# unpacks it into $M3_SITE (default build/m3-site), registers the plugin and probe entry points and
# sets PYTHONPATH and the NCCL environment. Then runs lab/gpu/sglang_h200.py, which writes
# results.json, server_logs.txt and table.md (last) into $OUT (default out/sglang_h200). Extra
# arguments go to sglang_h200.py.
#
#   lab/gpu/run_sglang_h200.sh                        # the full check and timing
#   lab/gpu/run_sglang_h200.sh --formats mxfp4 --batches 1
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-out/sglang_h200}"
mkdir -p "$OUT"
source lab/gpu/bundle_env.sh || exit 1
python3 lab/gpu/sglang_h200.py --out "$OUT" "$@" 2>&1 | tee "$OUT/driver.log"
