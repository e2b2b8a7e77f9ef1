#!/usr/bin/env bash
# Tensor and context parallelism on two GPUs (an H200 pair), NVLink multicast off:
#   1. the context-parallel scorer across both GPUs (tests/kernels/ops/score/test_cp_multigpu.py,
#      world 2 over NCCL; skipped with M3_SKIP_CP=1), log in $OUT/cp_multigpu.log;
#   2. lab/gpu/sglang_tp2.py: SGLang servers with --tp 2 against --tp 1 on one random
#      checkpoint, fp8 and MXFP4 index-K caches; results.json, server_logs.txt, table.md (last).
#
# Runs from the repo root with the wheel bundle in .whl1/ (lab/gpu/bundle_env.sh unpacks it).
# $OUT defaults to out/tp2_h200. Extra arguments go to sglang_tp2.py. The whole script ends within
# M3_RUN_LIMIT_S seconds (default 560) of its start: the driver stops waiting and sending requests
# 40 s before that and writes its table with what it has.
#
#   lab/gpu/run_tp2_h200.sh                   # both parts (about 6-7 min on a fresh machine)
#   M3_SKIP_CP=1 lab/gpu/run_tp2_h200.sh --formats mxfp4 --eager
set -uo pipefail
cd "$(dirname "$0")/../.."
end_by=$(( $(date +%s) + ${M3_RUN_LIMIT_S:-560} ))
OUT="${OUT:-out/tp2_h200}"
mkdir -p "$OUT"
source lab/gpu/bundle_env.sh || exit 1
cp_rc=0
if [ "${M3_SKIP_CP:-0}" != 1 ]; then
    timeout 240 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/kernels/ops/score/test_cp_multigpu.py \
        2>&1 | tee "$OUT/cp_multigpu.log"
    cp_rc=${PIPESTATUS[0]}
    echo "context-parallel test exit code: $cp_rc" | tee -a "$OUT/cp_multigpu.log"
fi
python3 lab/gpu/sglang_tp2.py --out "$OUT" --cp-log "$OUT/cp_multigpu.log" --end-by "$end_by" "$@" 2>&1 \
    | tee "$OUT/driver.log"
exit $(( cp_rc | PIPESTATUS[0] ))
