"""One shape of the CUDA MXFP4 decode scorer for a profiler (Nsight Compute) on an H200.

    ncu --kernel-name regex:score_decode_mxfp4 --launch-skip 3 --launch-count 1 \
        --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        python3 lab/gpu/profile_cuda_scorer.py [--batch 32 --ctx 131072 --S 4 --H 1]

Random MXFP4 pages (e8m0 bytes 122..127), a uniform context, 5 launches.
"""

import argparse
import math

import torch

from m3_kernels.formats import INDEX_DIM, MXFP4_PAGE_BYTES, PAGE_SIZE, IndexKCache, mxfp4_page_views
from m3_kernels.ops.score import DecodeBatch, plan_decode, score_decode


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--S", type=int, default=4)
    ap.add_argument("--H", type=int, default=1)
    args = ap.parse_args()
    npg = math.ceil(args.ctx / PAGE_SIZE)
    pages = args.batch * npg + 1
    region = torch.randint(0, 256, (pages, MXFP4_PAGE_BYTES), dtype=torch.uint8, device="cuda")
    k_data, k_scale = mxfp4_page_views(region)
    k_scale.random_(122, 128)
    bt = torch.randperm(pages, device="cuda")[: args.batch * npg].reshape(args.batch, npg).int()
    seq = torch.full((args.batch,), args.ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(args.batch * args.S, args.H, INDEX_DIM, device="cuda").bfloat16()
    out = torch.empty(args.H, args.batch * args.S, npg, device="cuda")
    cache = IndexKCache("mxfp4", k_data, k_scale)
    plan = plan_decode(cache, DecodeBatch(bt, seq, args.S, args.H, 0.1, npg, out), backend="cuda")
    for _ in range(5):
        score_decode(plan, q, cache, out)
    torch.cuda.synchronize()
    print("done", tuple(out.shape))


if __name__ == "__main__":
    main()
