"""Print what the FlyDSL decode scorer compiles to for gfx950, per specialisation (no GPU needed).

    python lab/scripts/flydsl_isa_report.py [--arch gfx950]

Each specialisation is a real decode call built on the CPU, lowered through FlyDSL's pipeline in
compile-only mode and turned into assembly with gpu-module-to-binary{format=isa}.
"""

import argparse
import time

import torch

from m3_kernels.formats import FP8_DTYPE, PAGE_SIZE, alloc_index_k_cache
from m3_kernels.ops.score.backends.flydsl.host import prepare_decode
from m3_kernels.ops.score.backends.flydsl.isa import instruction_counts, kernel_resources, lower_to_isa

COLUMNS = {
    "cvt_fp4": "v_cvt_scalef32_pk_bf16_fp4",
    "cvt_fp8": "v_cvt_scalef32_pk_bf16_fp8",
    "mfma_bf16": "v_mfma_f32_16x16x32_bf16",
    "mfma_scale": "v_mfma_scale_f32_16x16x128_f8f6f4",
    "ld_x4": "buffer_load_dwordx4",
    "ld_x1": "buffer_load_dword",
    "bperm": "ds_bpermute_b32",
    "st": "buffer_store_dword",
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="gfx950")
    args = parser.parse_args()
    print(f"arch {args.arch}; counts per kernel (a wave scores 2 pages = 16 K tiles, unrolled)")
    print(f"{'cache':6} {'q':5} {'S':>2} {'H':>2} " + " ".join(f"{c:>10}" for c in COLUMNS)
          + f" {'vgpr':>5} {'scratch':>7} {'spills':>6} {'s':>5}")
    for fmt in ("mxfp4", "fp8", "bf16"):
        for q_name, q_dtype in (("bf16", torch.bfloat16), ("e4m3", FP8_DTYPE)):
            for S in (1, 2, 4):
                for H in (1, 4):
                    k_cache, k_scale = alloc_index_k_cache(4, fmt)
                    q = torch.randn(2 * S, H, 128).to(q_dtype)
                    bt = torch.zeros(2, 4, dtype=torch.int32)
                    seq = torch.tensor([3 * PAGE_SIZE, S], dtype=torch.int32)
                    launcher, launch_args, _ = prepare_decode(q, k_cache, k_scale, bt, seq, S, 0.1)
                    t0 = time.perf_counter()
                    isa = lower_to_isa(launcher, *launch_args, arch=args.arch)
                    dt = time.perf_counter() - t0
                    c, r = instruction_counts(isa), kernel_resources(isa)
                    spills = r.get("vgpr_spill_count", 0) + r.get("sgpr_spill_count", 0)
                    cells = " ".join(f"{c.get(n, 0):>10}" for n in COLUMNS.values())
                    print(f"{fmt:6} {q_name:5} {S:>2} {H:>2} {cells}"
                          f" {r['num_vgpr']:>5} {r['private_segment_fixed_size']:>7} {spills:>6} {dt:>5.2f}")


if __name__ == "__main__":
    main()
