#!/usr/bin/env bash
# SGLang 0.5.16 + sglang-m3 on an H200: CUDA-graph decode with bf16, fp8 and MXFP4 index-K caches.
#
# Runs on the GPU machine from the repo root, with the bundle made by
# scripts/gpu/build_wheel_bundle.sh in .whl1/ (.whl2/, ... if it was split): joins and unpacks it
# into $M3_SITE (default build/m3-site, git-ignored; kept if already complete), registers this repo's SGLang
# plugin entry point (and the decode-input probe used by the selection check) with a small
# dist-info, puts the bundle, the repo and kernels/ on PYTHONPATH and runs
# scripts/gpu/sglang_h200.py, which writes results.json, server_logs.txt and table.md (last) into
# $OUT (default out/sglang_h200). Extra arguments go to sglang_h200.py.
#
#   scripts/gpu/run_sglang_h200.sh                        # the full check and timing
#   scripts/gpu/run_sglang_h200.sh --formats mxfp4 --batches 1
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-out/sglang_h200}"
SITE="$(realpath -m "${M3_SITE:-build/m3-site}")"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

if [ ! -f "$SITE/.complete" ]; then
    rm -rf "$SITE" && mkdir -p "$SITE"
    t0=$(date +%s)
    cat .whl[0-9]*/gpu-site.tar.xz.part | python3 -c "
import sys, tarfile
with tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz') as t:
    t.extractall(sys.argv[1], filter='tar')
" "$SITE" || { echo "bundle unpack failed" >&2; exit 1; }
    touch "$SITE/.complete"
    echo "bundle unpacked into $SITE in $(( $(date +%s) - t0 )) s"
fi

# Entry points: this repo's plugin (pyproject's sglang.srt.plugins) and the probe.
DIST="$SITE/sglang_m3_gpu_run-0.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: sglang-m3-gpu-run\nVersion: 0\n' > "$DIST/METADATA"
printf '[sglang.srt.plugins]\nminimax_m3_1 = sglang_m3.plugin:register\nm3_gpu_probe = m3_gpu_probe:register\n' \
    > "$DIST/entry_points.txt"
export PYTHONPATH="$SITE:$PWD:$PWD/kernels:$PWD/scripts/gpu${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
python3 -c "import torch, sglang, sgl_kernel, sglang_m3.plugin, m3_kernels; print('torch', torch.__version__, \
'sglang', sglang.__version__, 'cuda', torch.cuda.is_available())" || exit 1
python3 scripts/gpu/sglang_h200.py --out "$OUT" "$@" 2>&1 | tee "$OUT/driver.log"
