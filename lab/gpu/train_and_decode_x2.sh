#!/usr/bin/env bash
# One call on a host with two H200s: GPU 0 trains the small MSA model (train_msa_h200.sh), GPU 1 runs
# the SGLang CUDA-graph decode table for one or more index-K formats (run_sglang_h200.sh), side by
# side. Each job gets its own CPU cores (taskset halves) and output folder; the SGLang folder is packed
# into one sglang.tgz so that, with the trainer's call.log, metrics.jsonl and at most 5 export parts,
# no more than 8 files come back.
#
#   FORMATS=fp8 lab/gpu/train_and_decode_x2.sh [train.py args]
#   RESUME=build/msa-train FORMATS=mxfp4 lab/gpu/train_and_decode_x2.sh
#
# Env: FORMATS (default fp8; "" = GPU 1 idle), SGLANG_ARGS (default: the issue-6 table,
# --skip-capacity --eager skip --graph-bs 1,8,32 --budget-s 530), RESUME, BUDGET_S (trainer, 540),
# OUT (default out/x2).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-out/x2}"
FORMATS="${FORMATS-fp8}"
SGLANG_ARGS="${SGLANG_ARGS:---skip-capacity --eager skip --graph-bs 1,8,32 --budget-s 530}"
mkdir -p "$OUT/train"
half=$(( $(nproc) / 2 ))
pin() { if command -v taskset > /dev/null; then taskset -c "$@"; else shift; "$@"; fi; }

CUDA_VISIBLE_DEVICES=0 OUT="$OUT/train" MAX_EXPORT_PARTS=5 pin 0-$(( half - 1 )) \
    lab/gpu/train_msa_h200.sh "$@" > /dev/null 2>&1 &
train_pid=$!
sglang_pid=
if [ -n "$FORMATS" ]; then
    tmp=$(mktemp -d)
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=1 OUT="$tmp/sglang" pin "$half-$(( 2 * half - 1 ))" \
        lab/gpu/run_sglang_h200.sh --formats "$FORMATS" $SGLANG_ARGS > "$tmp/sglang.stdout" 2>&1 &
    sglang_pid=$!
fi
wait "$train_pid"; train_rc=$?
sglang_rc=0
if [ -n "$sglang_pid" ]; then
    wait "$sglang_pid"; sglang_rc=$?
    mv "$tmp/sglang.stdout" "$tmp/sglang/" 2>/dev/null
    tar -C "$tmp" -czf "$OUT/sglang.tgz" sglang
    rm -rf "$tmp"
fi
tail -n 40 "$OUT/train/call.log"
[ -n "$sglang_pid" ] && tar -xzOf "$OUT/sglang.tgz" sglang/table.md 2>/dev/null
echo "train rc=$train_rc sglang rc=$sglang_rc; files back: $(find "$OUT" -type f | wc -l)"
