#!/usr/bin/env bash
# On a CUDA GPU: every gpu-marked test under tests/ (the GPU suite: a new gpu test is in it by being
# marked), then the scorer/writer benchmark (correctness first).
#   scripts/run_gpu_tests.sh [bench args...]     logs and tables go to $OUT (default ./out)
#   scripts/run_gpu_tests.sh --tests-only        the GPU suite alone, log in $OUT/pytest_gpu.log
#   GPU_TESTS="tests/kernels tests/accuracy"     a shard of it (default: tests), where one call cannot hold all;
#                                                at PYTEST_TIMEOUT (480 s) pytest is interrupted and still prints its counts
#   scripts/run_gpu_tests.sh --multi-gpu         only the 2-GPU context-parallel scorer test (NCCL,
#                                                 NVLink multicast off), log in $OUT/pytest_multi_gpu.log
# Needs torch, Triton and SGLang importable by python3 (SGLang's JIT loader builds the CUDA MXFP4
# scorer; its M3 scorer is the peer baseline): an environment made by scripts/setup.sh, or any other.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}
if [ "${1:-}" = "--multi-gpu" ]; then
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    timeout ${PYTEST_TIMEOUT:-300} python3 -m pytest -q -s -m gpu -p no:cacheprovider \
        tests/kernels/ops/score/test_cp_multigpu.py ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_multi_gpu.log"
    exit ${PIPESTATUS[0]}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
timeout -s INT -k 30 ${PYTEST_TIMEOUT:-480} python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests} ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/pytest_gpu.log"
tests_rc=${PIPESTATUS[0]}
echo "gpu tests exit code: $tests_rc" | tee -a "$OUT/pytest_gpu.log"
[ "${1:-}" = "--tests-only" ] && exit "$tests_rc"
if [ "$tests_rc" != 0 ]; then
    echo "CORRECTNESS GATE FAILED: benchmark numbers below are not a claim" | tee "$OUT/GATE_FAILED"
fi
python3 tests/benchmarks/bench_score.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
exit $(( tests_rc | PIPESTATUS[0] ))
