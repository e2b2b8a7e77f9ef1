#!/usr/bin/env bash
# On a GPU machine with the wheel bundle carried (lab/gpu/bundle_env.sh), in phases that fit one call each:
#   lab/gpu/before_after.sh tests              the GPU suite at this tree (scripts/run_gpu_tests.sh --tests-only:
#                                              every gpu-marked test under tests/; the correctness gate; record
#                                              the result with lab/gpu/gate.py record)
#   lab/gpu/before_after.sh bench ARM ...      tests/benchmarks/bench_score.py --quick --no-peer per ARM, in order:
#                                              after* = this tree, before* = the tree unpacked in build/before
#                                              (git archive REV kernels tests/benchmarks | tar -x -C build/before)
#   lab/gpu/before_after.sh prefill [ARG ...]  tests/benchmarks/bench_prefill.py ARG ... (sm_90 vs portable prefill
#                                              scorer, and SGLang's own M3 prefill indexer beside ours + selector)
# Logs and tables under $OUT (default ./out); a phase after a failed gate refuses to time. On a fresh H200
# (2026-12-07) the tests phase did not finish in 280 s (bundle unpack, bytecode, JIT builds, then the tests):
# give it a call of its own with the whole 600 s.
set -uo pipefail
cd "$(dirname "$0")/../.."
source lab/gpu/bundle_env.sh > /dev/null || exit 1
OUT=${OUT:-./out}
mkdir -p "$OUT"
phase=${1:-tests}
shift || true
case "$phase" in
tests)
    OUT=$OUT scripts/run_gpu_tests.sh --tests-only > /dev/null 2>&1
    rc=$?
    grep -E "passed|failed|error" "$OUT/pytest_gpu.log" | tail -n 3
    grep -E "^FAILED|^ERROR" "$OUT/pytest_gpu.log" | head -n 20
    [ "$rc" = 0 ] || touch "$OUT/GATE_FAILED"
    exit "$rc" ;;
bench)
    [ -f "$OUT/GATE_FAILED" ] && { echo "correctness gate failed: no timing"; exit 1; }
    here=$PYTHONPATH
    for arm in "$@"; do
        root=.
        [ "${arm#before}" != "$arm" ] && root=build/before
        mkdir -p "$OUT/$arm"
        PYTHONPATH="$PWD/$root/kernels:$here" timeout 280 python3 "$root/tests/benchmarks/bench_score.py" --quick \
            --no-peer --out "$OUT/$arm" > "$OUT/$arm/log.txt" 2>&1 || { echo "$arm failed"; tail -n 15 "$OUT/$arm/log.txt"; }
        echo "== $arm"; grep -E "^\| S" "$OUT/$arm/bench_score.md" | cut -d'|' -f2-10,14
    done ;;
prefill)
    [ -f "$OUT/GATE_FAILED" ] && { echo "correctness gate failed: no timing"; exit 1; }
    timeout 540 python3 tests/benchmarks/bench_prefill.py --out "$OUT" "$@" > "$OUT/prefill_log.txt" 2>&1
    rc=$?
    tail -n 25 "$OUT/prefill_log.txt"
    exit "$rc" ;;
*) echo "phase must be tests, bench or prefill, got $phase" >&2; exit 2 ;;
esac
