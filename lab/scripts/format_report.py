"""Print what each index-K format costs and keeps: bytes per token, SQNR of a round trip on
random keys with outlier channels, and top-16 block agreement with bf16.

    .venv/bin/python lab/scripts/format_report.py [--tokens 16384] [--seed 0]

Evidence only (the product's formats module does not import it); the float64 references of the
writer, scorer and selector do the work.
"""

import argparse

import torch

from m3_kernels.formats import (
    INDEX_DIM,
    PAGE_SIZE,
    IndexKFormat,
    alloc_index_k_cache,
    dequantize_index_k,
    prepare_index_q,
    quantize_index_k,
    rotate,
)
from m3_kernels.ops.score.naive import score_decode_ref
from m3_kernels.ops.select.naive import select_blocks_ref, visible_blocks
from m3_kernels.ops.write.naive import write_index_k_ref


def _keys(tokens: int, gen: torch.Generator) -> torch.Tensor:
    k = torch.randn(tokens, INDEX_DIM, generator=gen)
    k[:, :4] *= 8.0  # a few outlier channels, as post-RoPE keys have
    return k


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--queries", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    k = _keys(args.tokens, gen)
    q = (torch.randn(args.queries, 4, INDEX_DIM, generator=gen) + k[:64].mean(0)).bfloat16()
    pages = (args.tokens + PAGE_SIZE - 1) // PAGE_SIZE
    block_table = torch.arange(pages, dtype=torch.int32)[None]
    seq_lens = torch.tensor([args.tokens], dtype=torch.int32)
    n_visible = visible_blocks(torch.full((args.queries,), args.tokens - 1), PAGE_SIZE)

    selected = {}
    print(f"{args.tokens} random keys (4 outlier channels x8), {args.queries} queries x 4 heads, top-16 of {pages} "
          "blocks")
    print("| format | B/token | vs bf16 | SQNR dB | top-16 overlap with bf16 |")
    print("|---|---|---|---|---|")
    for fmt in IndexKFormat:
        rows, scales = quantize_index_k(k, fmt)
        ref = rotate(k) if fmt.is_rotated else k
        err = dequantize_index_k(rows, scales) - ref
        sqnr = 10 * torch.log10(ref.pow(2).sum() / err.pow(2).sum()).item()
        k_cache, k_scale = alloc_index_k_cache(pages, fmt)
        write_index_k_ref(k, torch.arange(args.tokens), k_cache, k_scale, fmt)
        q_rows = prepare_index_q(q, fmt)
        scores = score_decode_ref(q_rows, k_cache, k_scale, block_table.expand(args.queries, -1).contiguous(),
                                  seq_lens.expand(args.queries).contiguous(), 1, 1.0)
        selected[fmt] = select_blocks_ref(scores, n_visible)
        overlap = _overlap(selected[fmt], selected[IndexKFormat.BF16])
        print(f"| {fmt.value} | {fmt.token_bytes} | {fmt.token_bytes / IndexKFormat.BF16.token_bytes:.3f} | "
              f"{sqnr:.1f} | {100 * overlap:.1f}% |")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    hits = total = 0
    for x, y in zip(a.reshape(-1, a.shape[-1]).tolist(), b.reshape(-1, b.shape[-1]).tolist()):
        sy = {v for v in y if v >= 0}
        hits += len({v for v in x if v >= 0} & sy)
        total += len(sy)
    return hits / max(total, 1)


if __name__ == "__main__":
    main()
