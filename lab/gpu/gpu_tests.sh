#!/usr/bin/env bash
# On a GPU machine with no network: unpack the carried SGLang wheel bundle (bundle_env.sh), run the
# product's scripts/run_gpu_tests.sh with the same arguments (logs and tables in $OUT), then the GPU tests
# of the lab's benchmarks of SGLang's sparse-attention kernels.
#   lab/gpu/gpu_tests.sh [args of scripts/run_gpu_tests.sh]
set -uo pipefail
cd "$(dirname "$0")/../.."
source lab/gpu/bundle_env.sh || exit 1
OUT=${OUT:-./out} scripts/run_gpu_tests.sh "$@"
rc=$?
[ "${1:-}" = "--multi-gpu" ] && exit $rc
timeout ${PYTEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider lab/tests/scripts/test_bench_sparse_prefill.py \
    lab/tests/scripts/test_bench_sparse_decode.py 2>&1 | tee "${OUT:-./out}/pytest_gpu_lab.log"
exit $(( rc | PIPESTATUS[0] ))
