#!/usr/bin/env bash
# On a GPU machine with the wheel bundle carried: the product's GPU tests at this tree, then the decode scorer
# and writer benchmark (tests/benchmarks/bench_score.py --quick --no-peer) A-B-B-A between this tree (A) and
# an earlier one unpacked under before/ (B: `git archive REV kernels tests/benchmarks | tar -x -C before`),
# then the prefill scorer benchmark. Tables in $OUT/{after1,before1,before2,after2}/bench_score.md.
#   lab/gpu/before_after.sh [pytest -k expression]
set -uo pipefail
cd "$(dirname "$0")/../.."
source lab/gpu/bundle_env.sh || exit 1
OUT=${OUT:-./out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/kernels/ops/write/test_triton.py \
    tests/kernels/ops/score tests/kernels/ops/select/test_triton.py tests/kernels/ops/test_pdl.py \
    tests/sglang_m3/test_sparse_attention.py ${1:+-k "$1"} > "$OUT/pytest_gpu.log" 2>&1
rc=$?
tail -n 5 "$OUT/pytest_gpu.log"
[ "$rc" = 0 ] || { echo "CORRECTNESS GATE FAILED ($rc): no timing"; exit "$rc"; }
here=$PYTHONPATH
for arm in after1 before1 before2 after2; do
    if [ "${arm#before}" != "$arm" ]; then
        root=before
    else
        root=.
    fi
    mkdir -p "$OUT/$arm"
    PYTHONPATH="$PWD/$root/kernels:$here" timeout 300 python3 "$root/tests/benchmarks/bench_score.py" --quick --no-peer \
        --out "$OUT/$arm" > "$OUT/$arm/log.txt" 2>&1 || { echo "$arm failed"; tail -n 20 "$OUT/$arm/log.txt"; }
done
for arm in after1 before1 before2 after2; do echo "== $arm"; grep -E "^\| S" "$OUT/$arm/bench_score.md" | cut -d'|' -f2-10; done
