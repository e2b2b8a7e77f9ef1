#!/usr/bin/env bash
# Build the package bundle that brings SGLang 0.5.16 to an H200 machine with no network.
#
# The machine's image has Python 3.12, torch 2.11 and triton 3.6 but no SGLang, and a call may carry
# at most 64 MiB of files. This script:
#   1. downloads the cp312 wheels pinned in lab/gpu/bundle-requirements.txt (no dependencies
#      resolved: the list is the closed set that was seen to import and serve there);
#   2. unpacks them into one site directory and removes what the server path on sm_90 never loads:
#        sgl_kernel/flash_ops.abi3.so (FlashAttention-3, 1.1 GB; we serve dense layers with
#        --attention-backend triton), sgl_kernel/sm100/ (Blackwell build), sgl_kernel/infllm_ops*.so
#        and sgl_kernel/flashmla_ops.abi3.so (loaded lazily / inside try by their only users),
#        xgrammar/lib/libxgrammar.a (static library for C++ builds), flashinfer/data/{cutlass,cccl}
#        (headers for flashinfer's JIT builds; we use no flashinfer kernel), jedi/third_party
#        (typeshed stubs for IPython completion), sglang/multimodal_gen (diffusion server),
#        zstandard's cffi backend (the C backend is the default), lm_eval/tasks/*/ (lm-eval's own task
#        folders, 75 MB: m3-accuracy loads accuracy/tasks only, include_defaults=False);
#   3. writes one xz-compressed tar of that directory, split into parts of at most PART_MIB (58) MiB,
#      into the git-ignored folders .whl1/, .whl2/, ... at the repo root (one part per folder, so each
#      call can carry what it needs; each folder's `parts` file holds the number of parts). The working
#      tree travels with every call (64 MiB in all): when it and the bundle do not fit one call, make
#      smaller parts (PART_MIB=20) and carry one per call on a held machine, where carried folders stay
#      until every part is there (lab/gpu/bundle_env.sh unpacks once they are).
# On the GPU machine, lab/gpu/run_sglang_h200.sh joins the parts and unpacks them into a
# directory it puts on PYTHONPATH, in front of the image's site-packages.
#
# Usage: lab/gpu/build_wheel_bundle.sh            (env: PYTHON=python3, XZ_LEVEL=9, PART_MIB=58,
#                                                      NO_DOWNLOAD=1: build/wheels-cp312 already holds them)
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
XZ_LEVEL="${XZ_LEVEL:-9}"
PART_MIB="${PART_MIB:-58}"
PART_BYTES=$((PART_MIB * 1024 * 1024))
WHEELS=build/wheels-cp312
SITE=build/gpu-site

mkdir -p "$WHEELS"
# pip matches each manylinux tag exactly, so list every glibc level the pinned wheels use.
platforms=()
for tag in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
           manylinux2014 manylinux_2_5 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
grep -v '^#' lab/gpu/bundle-requirements.txt | sed '/^\s*$/d' > build/bundle-requirements.flat
if [ -z "${NO_DOWNLOAD:-}" ]; then
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$WHEELS" -r build/bundle-requirements.flat
fi

# Exactly one wheel per requirement: two versions of one package would both be unpacked.
want=$(wc -l < build/bundle-requirements.flat)
have=$(ls "$WHEELS"/*.whl | wc -l)
if [ "$want" != "$have" ]; then
    echo "expected $want wheels in $WHEELS, found $have: remove stale ones" >&2
    exit 1
fi

rm -rf "$SITE" && mkdir -p "$SITE"
for whl in "$WHEELS"/*.whl; do
    "$PYTHON" -m zipfile -e "$whl" "$SITE"
done
rm -rf "$SITE"/sgl_kernel/flash_ops.abi3.so "$SITE"/sgl_kernel/sm100 "$SITE"/sgl_kernel/infllm_ops*.so \
       "$SITE"/sgl_kernel/flashmla_ops.abi3.so "$SITE"/xgrammar/lib/libxgrammar.a \
       "$SITE"/flashinfer/data/cutlass "$SITE"/flashinfer/data/cccl "$SITE"/jedi/third_party \
       "$SITE"/sglang/multimodal_gen "$SITE"/zstandard/_cffi.*.so
find "$SITE"/lm_eval/tasks -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
find "$SITE" -name __pycache__ -type d -prune -exec rm -rf {} +
# Console scripts are not needed (everything runs as python3 -m ...); wheels' data dirs likewise.
rm -rf "$SITE"/*.data

rm -rf .whl[0-9]*
tar -C "$SITE" --sort=name --owner=0 --group=0 --numeric-owner -cf - . \
    | xz -T0 -"$XZ_LEVEL" > build/gpu-site.tar.xz
size=$(stat -c %s build/gpu-site.tar.xz)
n=0
while [ $((n * PART_BYTES)) -lt "$size" ]; do
    n=$((n + 1))
    mkdir -p ".whl$n"
    dd if=build/gpu-site.tar.xz of=".whl$n/gpu-site.tar.xz.part" bs=1M \
        skip=$(((n - 1) * PART_MIB)) count="$PART_MIB" status=none
done
for d in .whl[0-9]*/; do echo "$n" > "$d/parts"; done
echo "bundle: $(du -sh "$SITE" | cut -f1) unpacked, $((size / 1048576)) MiB compressed, $n part(s):"
ls -l .whl[0-9]*/
