"""Compile-time proxy for the Triton decode scorer: sm_90 SASS of the page loop, no GPU needed.

    python lab/scripts/sass_report.py [--variants fp8,mxfp4,mxfp4_per_group] [--q bf16|e4m3] [--dump DIR]
    python lab/scripts/sass_report.py --writer

Compiles ``_score_kernel`` for an sm_90 target (Triton's bundled ptxas), as the Triton backend's ``run``
launches it for the benchmark's S4 H1 decode cells (4 query vectors per tile, padded to 16, 16 pages
per program, 2 pipeline stages, 4 warps, preallocated output), disassembles it with the bundled
``cuobjdump`` and prints, per variant, one row per page loop: instructions per thread in the loop
(the body between the loop label and its backward branch; it handles one page per trip), how many
of them a forward branch inside the loop can skip ("skippable": the position mask where it runs on
the tile's last pages only), selected opcode counts in that body, registers per thread and the stack
frame (spills). ``mxfp4``: the stacked loop (tiles of <= 8 query vectors), then the per-vector
fallback loop; ``mxfp4_per_group``: the loop of larger tiles, then the same fallback. A proxy for
issue cost only: it is not a timing.

``--writer``: the index-cache writer instead (``ops/write/triton.py``, fp32 keys, int64 slots,
rceil), plain mxfp4 at its launch and mxfp4_rot at several: SASS instructions per thread of the
whole kernel (straight-line code; mxfp4_rot's rarely taken range-edge branch included, so an upper
bound for its common path) and per token (times the program's threads, over its tokens).
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from m3_kernels.formats import MXFP4_INPUT_MAX
from m3_kernels.ops.pdl import have_triton_gdc
from m3_kernels.ops.score.backends import triton as score_triton
from m3_kernels.ops.write import triton as write_triton

TARGET = GPUTarget("cuda", 90, 32)
OPCODES = ["HGMMA", "QGMMA", "HMMA", "LDG", "LDGSTS", "LDS", "LDSM", "STS", "PRMT", "LOP3", "SHF", "IMAD", "FMUL",
           "FFMA", "FADD", "F2FP", "BAR", "LDL", "STL"]
# variant -> (FMT code, constexpr overrides)
VARIANTS = {"fp8": (1, {}), "mxfp4": (2, {}), "mxfp4_per_group": (2, {"MX_STACK": False})}


def _tool(name):
    base = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return base if os.path.exists(base) else name


def compile_variant(fmt_code, q_fp8=False, nq=16, rows=4, heads=1, pp=16, num_stages=2, num_warps=4,
                    overrides=None):
    """The compiled kernel (``triton.compile`` result) of one decode configuration for sm_90."""
    fn = score_triton._score_kernel
    q_type = "*fp8e4nv" if q_fp8 else "*bf16"
    k_type = "*u8" if fmt_code == 2 else "*fp8e4nv"
    sig = dict(q_ptr=q_type, k_ptr=k_type, s_ptr="*u8" if fmt_code == 2 else "constexpr", bt_ptr="*i32",
               seq_ptr="*i32", cu_ptr="constexpr", tile_ptr="constexpr", out_ptr="*fp32", n_cols="i32", n_pages="i32",
               S="i32", cp_rank="i32", cp_world="i32", sm_scale="fp32", stride_q_r="i32", stride_q_h="i32",
               stride_k_page="i32", stride_s_page="i32", stride_bt="i32", stride_o_h="i32", stride_o_r="i32")
    const = dict(cu_ptr=None, tile_ptr=None, FMT=fmt_code, Q_FP8=q_fp8, H=heads, ROWS=rows, NQ=nq, PP=pp,
                 PREFILL=False, FILL_TAIL=False, NUM_STAGES=num_stages, USE_ASM=True,
                 USE_PDL=have_triton_gdc())  # as launched on sm_90 (ops.pdl.use_pdl)
    const.update(score_triton._static_constexprs(), INTERPRET=False)
    nv = max(4, triton.next_power_of_2(rows * heads))  # as score_triton.run
    const.update(NV=nv, MX_STACK=nv <= score_triton._MX_STACK_MAX_NV)
    const.update(overrides or {})
    if fmt_code != 2:
        const["s_ptr"] = None
    for name in fn.arg_names:
        sig.setdefault(name, "constexpr")
    missing = [n for n in fn.arg_names if sig[n] == "constexpr" and n not in const]
    if missing:
        raise RuntimeError(f"no value for constexpr arguments {missing}")
    aligned = {"stride_q_r", "stride_q_h", "stride_k_page", "stride_s_page"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if (n.endswith("_ptr") and sig[n] != "constexpr") or n in aligned}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=TARGET, options=dict(num_warps=num_warps))


def sass_of(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.check_output([_tool("cuobjdump"), "-sass", path], text=True)
    finally:
        os.unlink(path)


def resources(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        text = subprocess.check_output([_tool("cuobjdump"), "-res-usage", path], text=True)
    finally:
        os.unlink(path)
    out = {}
    for key in ("REG", "STACK", "SHARED", "LOCAL"):
        m = re.search(rf"\b{key}:(\d+)", text)
        out[key.lower()] = int(m.group(1)) if m else None
    return out


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def loops(sass: str):
    """Innermost loops (a backward branch with no other backward branch inside) that issue
    tensor-core instructions, in address order: list of opcode lists."""
    instrs = []
    for m in _INSTR.finditer(sass):
        text = re.sub(r"^@!?U?P[T0-9]+\s+", "", m.group(2).strip())
        instrs.append((int(m.group(1), 16), text))
    spans = []
    for addr, text in instrs:
        b = re.match(r"BRA\s+0x([0-9a-f]+)", text)
        if b and int(b.group(1), 16) < addr:
            spans.append((int(b.group(1), 16), addr))
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    out = []
    for lo, hi in sorted(inner):
        body = [t.split()[0] for a, t in instrs if lo <= a <= hi]
        if any("GMMA" in op or "HMMA" in op for op in body):
            # The longest stretch a conditional forward branch inside the loop can skip (the
            # position mask, where it is applied only to the tile's last pages).
            skip = 0
            for a, t in instrs:
                b = re.match(r"BRA\s+0x([0-9a-f]+)", t)
                if lo <= a <= hi and b and a < int(b.group(1), 16) <= hi:
                    skip = max(skip, sum(1 for x, _ in instrs if a < x < int(b.group(1), 16)))
            out.append((body, skip))
    return out


def report(name, kernel):
    """Rows (one per tensor-core page loop; the first is the main path, any later one a fallback)."""
    sass = sass_of(kernel.asm["cubin"])
    res = resources(kernel.asm["cubin"])
    res["shared"] = kernel.metadata.shared  # bytes, dynamic included
    rows = []
    for i, (body, skip) in enumerate(loops(sass)):
        hist = collections.Counter(op.split(".")[0] for op in body)
        row = {"variant": name if i == 0 else f"{name} (fallback loop {i})", "loop_instrs": len(body),
               "skippable": skip, **res}
        for op in OPCODES:
            row[op] = hist.get(op, 0)
        rows.append(row)
    return rows, sass


# (format, tokens per program, warps): mxfp4 at its launch, mxfp4_rot at its two defaults (from 16384 tokens,
# below: write_triton._rot_launch), then at other launches
WRITER_LAUNCHES = [("mxfp4", 16, 4), ("mxfp4_rot", 64, 4), ("mxfp4_rot", 16, 4), ("mxfp4_rot", 16, 2),
                   ("mxfp4_rot", 32, 2), ("mxfp4_rot", 64, 8)]


def compile_writer(rotated, bt, num_warps):
    """The writer kernel for sm_90 as ``write_index_k_triton`` launches it for fp32 keys, int64 slots
    and rceil (pointers and strides divisible by 16, as Triton specializes them)."""
    fn = write_triton._write_mxfp4_rot_kernel if rotated else write_triton._write_index_k_kernel
    sig = dict(k_ptr="*fp32", loc_ptr="*i64", cache_ptr="*u8", scale_ptr="*u8", n_tokens="i32", capacity="i32",
               stride_k_t="i32", stride_cache_page="i32", stride_scale_page="i32")
    const = dict(IN_BF16=False, RCEIL=True, BT=bt, D=128, G=32, PAGE=128, CLAMP=MXFP4_INPUT_MAX, S_MIN=1,
                 S_MAX=254, SIGN=8)
    if rotated:
        sig.update(h_ptr="*fp16", rot_scale="fp32")
        const.update(sign_ptr=None, SIGNS=False, PRE_CLAMP=write_triton._FP32_MAX)
    else:
        const.update(FMT=2)
    for name in fn.arg_names:
        sig.setdefault(name, "constexpr")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if (n.endswith("_ptr") and sig[n] != "constexpr") or n.startswith("stride")}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=TARGET, options=dict(num_warps=num_warps))


def writer_report():
    cols = ["format", "tokens/program", "warps", "per thread", "per token", "reg", "stack", "MMA", "BAR"]
    print("sm_90 SASS of the index-cache writer, whole kernel (compile-time proxy, not a timing)")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for fmt, bt, nw in WRITER_LAUNCHES:
        kernel = compile_writer(fmt == "mxfp4_rot", bt, nw)
        sass = sass_of(kernel.asm["cubin"])
        ops = [re.sub(r"^@!?U?P[T0-9]+\s+", "", m.group(2).strip()).split()[0] for m in _INSTR.finditer(sass)]
        hist = collections.Counter(op.split(".")[0] for op in ops)
        res = resources(kernel.asm["cubin"])
        row = [fmt, bt, nw, len(ops), round(len(ops) * 32 * nw / bt), res["reg"], res["stack"],
               hist["HMMA"] + hist["HGMMA"], hist["BAR"]]
        print("| " + " | ".join(str(v) for v in row) + " |", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--q", default="bf16", choices=["bf16", "e4m3"])
    parser.add_argument("--dump", help="write each variant's SASS and TTGIR here")
    parser.add_argument("--writer", action="store_true", help="the index-cache writer instead (module docstring)")
    args = parser.parse_args(argv)
    if args.writer:
        writer_report()
        return
    rows = []
    for name in args.variants.split(","):
        fmt_code, overrides = VARIANTS[name]
        kernel = compile_variant(fmt_code, q_fp8=args.q == "e4m3", pp=args.pp, num_stages=args.stages,
                                 num_warps=args.warps, overrides=overrides)
        new_rows, sass = report(name, kernel)
        rows += new_rows
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, f"{name}_{args.q}.sass"), "w") as f:
                f.write(sass)
            with open(os.path.join(args.dump, f"{name}_{args.q}.ttgir"), "w") as f:
                f.write(kernel.asm["ttgir"])
        print(f"{name}: {new_rows}", file=sys.stderr, flush=True)
    cols = ["variant", "loop_instrs", "skippable", "reg", "stack", "shared"] + OPCODES
    print(f"Q {args.q}; sm_90 page-loop SASS per thread (compile-time proxy, not a timing)")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
