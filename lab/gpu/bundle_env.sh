# Sourced (not run) by the GPU drivers from the repo root: unpacks the wheel bundle made by
# lab/gpu/build_wheel_bundle.sh (.whl1/, .whl2/, ... if it was split) into $M3_SITE (default
# build/m3-site, git-ignored; kept if already complete), registers this repo's SGLang plugin entry
# point and the drivers' probes (m3_gpu_probe: decode inputs; m3_load_check: checkpoint coverage;
# both idle unless their environment variable is set) with a small dist-info, writes the bytecode of the
# bundle and of torch, triton, sympy and numpy once (lab/gpu/precompile.py), exports PYTHONPATH
# (bundle, repo, kernels/, lab/gpu) and the NCCL settings (NVLink multicast off), prints the
# GPUs and versions. Returns non-zero if the bundle or the imports fail.
SITE="$(realpath -m "${M3_SITE:-build/m3-site}")"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

if [ ! -f "$SITE/.complete" ]; then
    # Parts carried by earlier calls on this machine count too; unpack only once all are here.
    want=$(cat .whl[0-9]*/parts 2>/dev/null | sort -u | head -n 1)
    have=$(ls .whl[0-9]*/gpu-site.tar.xz.part 2>/dev/null | wc -l)
    if [ -n "$want" ] && [ "$have" -lt "$want" ]; then
        echo "bundle: $have of $want parts here (.whl1/ ... .whl$want/); carry the others, one call each" >&2
        return 1
    fi
    rm -rf "$SITE" && mkdir -p "$SITE"
    t0=$(date +%s)
    cat .whl[0-9]*/gpu-site.tar.xz.part | python3 -c "
import sys, tarfile
with tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz') as t:
    t.extractall(sys.argv[1], filter='tar')
" "$SITE" || { echo "bundle unpack failed" >&2; return 1; }
    touch "$SITE/.complete"
    echo "bundle unpacked into $SITE in $(( $(date +%s) - t0 )) s"
fi

# Bytecode, once per machine (lab/gpu/precompile.py): every server start on an H200, on a held machine too,
# compiled bundle modules from source; the bundle and the interpreter's largest packages, on all cores
if [ ! -f "$SITE/.bytecode" ]; then
    PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" python3 lab/gpu/precompile.py "$SITE" torch triton sympy numpy \
        && touch "$SITE/.bytecode"
fi

# Entry points: this repo's plugin (pyproject's sglang.srt.plugins) and the probes.
DIST="$SITE/sglang_m3_gpu_run-0.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: sglang-m3-gpu-run\nVersion: 0\n' > "$DIST/METADATA"
{
    printf '[sglang.srt.plugins]\nminimax_m3_1 = sglang_m3.plugin:register\n'
    printf 'm3_gpu_probe = m3_gpu_probe:register\nm3_load_check = m3_load_check:register\n'
} > "$DIST/entry_points.txt"
export PYTHONPATH="$SITE:$PWD:$PWD/kernels:$PWD/lab:$PWD/lab/gpu${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
python3 -c "import torch, sglang, sgl_kernel, sglang_m3.plugin, m3_kernels; print('torch', torch.__version__, \
'sglang', sglang.__version__, 'cuda', torch.cuda.is_available(), 'gpus', torch.cuda.device_count())" || return 1
