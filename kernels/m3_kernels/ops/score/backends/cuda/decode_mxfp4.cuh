// MXFP4 decode block scorer for NVIDIA Hopper (sm_90; any sm_90+ with bulk copies and mma.sync).
//
// Contract: ops.score.naive.score_decode_ref (docs/design.md, "The block scorer contract"). The Python
// side validates every argument before a launch (the cache when made, the batch in plan_decode with
// backends/cuda/__init__.py's check_plan); nothing here re-checks.
//
//   out[h, b*S + tok, p] = sm_scale * max_t dot(K[block_table[b, p], t], q[b*S + tok, h])
//   over tokens t with (p * cp_world + cp_rank) * 128 + t <= seq_lens[b] - S + tok
//
// Layout of the work. A persistent grid of warps; the flattened list of (request, local page) pairs
// (pages up to each request's last visible one) is split into equal contiguous runs, one per warp.
// Each warp streams its run through its own 2-stage ring of shared-memory page buffers filled by
// 1-D bulk copies (cp.async.bulk, 8192 data + 512 scale bytes per page) on mbarriers; no
// cross-warp synchronisation. A page is 8 tiles of 16 tokens; each tile is 8 mma.sync m16n8k16
// (fp16 in, fp32 accumulate) per group of 8 query vectors. Launched with programmatic dependent
// launch when asked (ops/pdl.py, opt-in): every thread waits on the kernels before it first, then
// releases the next one's launch.
//
// The dims are permuted (K and Q alike: a dot product does not change) so that a thread's A
// fragment of a token row over K = 128 is exactly MX group `lane % 4` of that row: one 16-byte
// shared load and one scale byte per row. Within group t, k-step j, slot s (0..3 over
// a0.lo, a0.hi, a2.lo, a2.hi) holds element 8 * (j / 2) + 2 * s + (j % 2), i.e. dim
// 32 t + that; Q's B fragment follows the same map.
//
// Numerics (exact products, fp32 accumulation):
// - e2m1 code c (sign s) becomes the fp16 bit pattern s << 15 | c << 9, i.e. exactly e2m1 * 2^-14
//   (code 1 is an fp16 subnormal): per 8 codes 1 shift, 4 LOP3, 3 IMAD and 4 PRMT.
// - Each row's group is multiplied (one exact HMUL2 per pair) by 2^(e - E + 15), E the page's
//   largest scale byte: K = e2m1 * 2^(e - E + 1), exact while e >= E - 24. Pages whose scale bytes
//   span more than 24 binades take the multi-pass path: per tile, one pass per band of 25 binades,
//   each pass's fp32 result scaled to the true value before the passes are summed.
// - A Q vector is scaled by 2^-qe (its largest magnitude to [2^14, 2^15)) and rounded to fp16:
//   exact for e4m3 Q; bf16 elements within 2^31 of the vector's largest are exact, smaller ones
//   round at 2^-38 of it. qe is undone after the page max, with the page's 2^(E - 128).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <algorithm>

namespace m3_mxfp4 {

constexpr int kPageTokens = 128;
constexpr int kDataRowBytes = 64;                       // 128 e2m1 codes
constexpr int kScaleRowBytes = 4;                       // 4 e8m0 bytes (groups of 32)
constexpr int kPageDataBytes = kPageTokens * kDataRowBytes;   // 8192
constexpr int kPageScaleBytes = kPageTokens * kScaleRowBytes;  // 512
constexpr int kStageBytes = kPageDataBytes + kPageScaleBytes;  // 8704
constexpr int kStages = 2;
constexpr int kWarps = 4;                               // warps per CTA
constexpr int kBarrierBytes = 128;                      // kWarps * kStages mbarriers, padded
constexpr int kSmemBytes = kBarrierBytes + kWarps * kStages * kStageBytes;
constexpr int kE8m0Bias = 127;                          // scale byte e means 2^(e - 127)
constexpr int kFp16Bias = 15;
constexpr int kMaxScaleSpan = 24;                       // binades one fp16 pass holds exactly
constexpr int kQTopExp = 14;                            // Q's largest magnitude in [2^14, 2^15)

// CTAs per SM: 3 (12 warps, shared memory bound) while registers allow; 2 for 3-4 n-tiles.
constexpr int ctas_per_sm(int n_tiles) { return n_tiles <= 2 ? 3 : 2; }

struct Params {
  const uint8_t* k_data;     // [pages, 128, 64] uint8, rows contiguous
  const uint8_t* k_scale;    // [pages, 128, 4] uint8, rows contiguous
  int64_t data_page_stride;  // bytes
  int64_t scale_page_stride; // bytes
  const uint8_t* q;          // [batch*S, H, 128] bf16 or e4m3, last dim contiguous
  int64_t q_row_stride;      // bytes
  int64_t q_head_stride;     // bytes
  const int32_t* block_table;
  int64_t bt_stride;         // elements
  const int32_t* seq_lens;
  float* out;                // [H, batch*S, >= max_block] fp32, last dim contiguous
  int64_t out_stride_h;      // elements
  int64_t out_stride_r;      // elements
  int batch, S, H, max_block, cp_rank, cp_world;
  int num_pages;             // pages of the cache: an id outside [0, num_pages) is read as page 0 and scores -inf
  float sm_scale;
};

// A block-table id that lies in the cache (the others are never read; their page scores -inf).
__device__ __forceinline__ bool page_in_cache(const Params& p, int id) { return (unsigned)id < (unsigned)p.num_pages; }

// ------------------------------------------------------------------ PTX helpers

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// 1-D bulk copy global -> shared, completion counted in bytes on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                          uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::
          "r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy)
      : "memory");
}

__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t hmul2_bits(uint32_t x, uint32_t m) {
  __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&x), *reinterpret_cast<const __half2*>(&m));
  return *reinterpret_cast<uint32_t*>(&r);
}

// fp16x2 multiplier 2^(e - E + 15) for a scale byte e in [E - 24, E]; 0 outside `in_band`.
__device__ __forceinline__ uint32_t group_multiplier(int e, int E, bool in_band) {
  uint32_t bits = static_cast<uint32_t>(e - E + 15 + kFp16Bias) << 10;  // fp16 exponent field
  return in_band ? bits * 0x00010001u : 0u;
}

// Eight e2m1 codes (one 32-bit word, code 2i in the low nibble of byte i) -> four fp16x2 registers
// scaled by `m`: r[0] = (el 0, el 2), r[1] = (4, 6), r[2] = (1, 3), r[3] = (5, 7).
__device__ __forceinline__ void decode8(uint32_t w, uint32_t m, uint32_t (&r)[4]) {
  // Per byte, nibble v = s*8 + c -> high byte of the fp16 pattern, 128 s + 2 c = 2 v + 14 * (v & 8).
  const uint32_t w2 = w << 1;   // low nibbles, doubled
  const uint32_t w3 = w >> 3;   // high nibbles, doubled
  const uint32_t lo = (w2 & 0x1E1E1E1Eu) + (w2 & 0x10101010u) * 7u;
  const uint32_t hi = (w3 & 0x1E1E1E1Eu) + (w3 & 0x10101010u) * 7u;
  r[0] = hmul2_bits(__byte_perm(lo, 0u, 0x1404), m);
  r[1] = hmul2_bits(__byte_perm(lo, 0u, 0x3424), m);
  r[2] = hmul2_bits(__byte_perm(hi, 0u, 0x1404), m);
  r[3] = hmul2_bits(__byte_perm(hi, 0u, 0x3424), m);
}

__device__ __forceinline__ uint32_t bytes_max(uint4 v) {
  uint32_t m = __vmaxu4(__vmaxu4(v.x, v.y), __vmaxu4(v.z, v.w));
  m = __vmaxu4(m, m >> 16);
  return __vmaxu4(m, m >> 8) & 0xFFu;
}

__device__ __forceinline__ uint32_t bytes_min(uint4 v) {
  uint32_t m = __vminu4(__vminu4(v.x, v.y), __vminu4(v.z, v.w));
  m = __vminu4(m, m >> 16);
  return __vminu4(m, m >> 8) & 0xFFu;
}

// ------------------------------------------------------------------ work map

__device__ __forceinline__ int local_pages(const Params& p, int seq_len) {
  const int last = seq_len - 1;
  const int n_global = last >= 0 ? last / kPageTokens + 1 : 0;
  const int n_local = (n_global - p.cp_rank + p.cp_world - 1) / p.cp_world;
  return min(p.max_block, max(0, n_local));
}

// Total pages of the batch (every lane gets it).
__device__ int total_pages(const Params& p, int lane) {
  int total = 0;
  for (int b0 = 0; b0 < p.batch; b0 += 32) {
    const int b = b0 + lane;
    int n = b < p.batch ? local_pages(p, p.seq_lens[b]) : 0;
    total += __reduce_add_sync(0xffffffffu, n);
  }
  return total;
}

// The (request, page) holding flattened index `start` (< total); warp-uniform result.
__device__ void locate(const Params& p, int lane, int start, int& b_out, int& page_out, int& n_out) {
  int base = 0;
  for (int b0 = 0; b0 < p.batch; b0 += 32) {
    const int b = b0 + lane;
    const int n = b < p.batch ? local_pages(p, p.seq_lens[b]) : 0;
    int incl = n;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    const uint32_t hit = __ballot_sync(0xffffffffu, base + incl > start);
    if (hit) {
      const int l = __ffs(hit) - 1;
      const int excl = __shfl_sync(0xffffffffu, incl - n, l);
      b_out = b0 + l;
      page_out = start - base - excl;
      n_out = __shfl_sync(0xffffffffu, n, l);
      return;
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  b_out = p.batch;
  page_out = 0;
  n_out = 0;
}

struct Cursor {
  int b, page, n;  // request, local page, the request's local page count
};

__device__ __forceinline__ void advance(const Params& p, Cursor& c) {
  if (++c.page < c.n) return;
  c.page = 0;
  do {
    ++c.b;
    c.n = c.b < p.batch ? local_pages(p, p.seq_lens[c.b]) : 1;
  } while (c.n == 0);
}

// ------------------------------------------------------------------ query vectors

template <int NT>
struct QState {
  uint32_t bq[NT][8][2];      // B fragments (fp16x2), vector nt*8 + g, group t
  int col_qe[NT][2];          // qe of this thread's C columns nt*8 + 2t + {0, 1}
  int col_pos[NT][2];         // their positions (-1: no such vector)
  int64_t col_out[NT][2];     // their out offsets without the page
};

template <int NT, bool Q_E4M3>
__device__ void load_q(const Params& p, int b, int seq_len, int lane, QState<NT>& qs) {
  const int g = lane >> 2, t = lane & 3;
  const int nv = p.S * p.H;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int n = nt * 8 + g;
    float x[32];
    if (n < nv) {
      const int tok = n / p.H, h = n - tok * p.H;
      const uint8_t* src = p.q + (int64_t)(b * p.S + tok) * p.q_row_stride + (int64_t)h * p.q_head_stride;
      if (Q_E4M3) {
        const uint4* v = reinterpret_cast<const uint4*>(src + 32 * t);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const uint4 u = v[k];
          const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&u);
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            __nv_fp8_e4m3 e;
            e.__x = bytes[i];
            x[16 * k + i] = float(e);
          }
        }
      } else {
        const uint4* v = reinterpret_cast<const uint4*>(src + 64 * t);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint4 u = v[k];
          const __nv_bfloat16* h8 = reinterpret_cast<const __nv_bfloat16*>(&u);
#pragma unroll
          for (int i = 0; i < 8; ++i) x[8 * k + i] = __bfloat162float(h8[i]);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < 32; ++i) x[i] = 0.f;
    }
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[i]));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    int ex = 0;
    if (amax > 0.f) frexpf(amax, &ex);  // amax = f * 2^ex, f in [0.5, 1)
    const int qe = amax > 0.f ? ex - 1 - kQTopExp : 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int e0 = 8 * (j >> 1) + (j & 1);
      __half2 lo = __halves2half2(__float2half_rn(ldexpf(x[e0], -qe)), __float2half_rn(ldexpf(x[e0 + 2], -qe)));
      __half2 hi = __halves2half2(__float2half_rn(ldexpf(x[e0 + 4], -qe)), __float2half_rn(ldexpf(x[e0 + 6], -qe)));
      qs.bq[nt][j][0] = *reinterpret_cast<uint32_t*>(&lo);
      qs.bq[nt][j][1] = *reinterpret_cast<uint32_t*>(&hi);
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = nt * 8 + 2 * t + c;
      qs.col_qe[nt][c] = __shfl_sync(0xffffffffu, qe, 4 * (2 * t + c));
      if (col < nv) {
        const int tok = col / p.H, h = col - tok * p.H;
        qs.col_pos[nt][c] = seq_len - p.S + tok;
        qs.col_out[nt][c] = (int64_t)h * p.out_stride_h + (int64_t)(b * p.S + tok) * p.out_stride_r;
      } else {
        qs.col_pos[nt][c] = -1;
        qs.col_out[nt][c] = 0;
      }
    }
  }
}

// ------------------------------------------------------------------ one tile

// acc[nt] = dot products of tile rows (16*tile + g, +8) with the query vectors, K scaled by m0/m1.
template <int NT>
__device__ __forceinline__ void tile_dots(const uint8_t* data, int tile, int lane, uint32_t m0, uint32_t m1,
                                          const QState<NT>& qs, float (&acc)[NT][4]) {
  const int g = lane >> 2, t = lane & 3;
  const int r0 = 16 * tile + g;
  const uint4 w0 = *reinterpret_cast<const uint4*>(data + r0 * kDataRowBytes + 16 * t);
  const uint4 w1 = *reinterpret_cast<const uint4*>(data + (r0 + 8) * kDataRowBytes + 16 * t);
  const uint32_t words0[4] = {w0.x, w0.y, w0.z, w0.w};
  const uint32_t words1[4] = {w1.x, w1.y, w1.z, w1.w};
  float acc2[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = acc2[nt][i] = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t a[4], b[4];
    decode8(words0[k], m0, a);
    decode8(words1[k], m1, b);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      // k-step 2k: slots (0,2 | 4,6); k-step 2k+1: (1,3 | 5,7). Two accumulator chains
      // while registers allow (NT <= 2).
      mma_16816(acc[nt], a[0], b[0], a[1], b[1], qs.bq[nt][2 * k][0], qs.bq[nt][2 * k][1]);
      mma_16816(NT <= 2 ? acc2[nt] : acc[nt], a[2], b[2], a[3], b[3], qs.bq[nt][2 * k + 1][0],
                qs.bq[nt][2 * k + 1][1]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] += NT <= 2 ? acc2[nt][i] : 0.f;
}

// Running max of a tile's 4 C values per n-tile into mx (cols 2t, 2t+1); rows past a column's
// limit (lim = position - page start) are skipped.
template <int NT, bool FULL>
__device__ __forceinline__ void tile_max(const float (&v)[NT][4], int r0, const int (&lim)[NT][2],
                                         float (&mx)[NT][2]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      if (FULL) {
        mx[nt][c] = fmaxf(mx[nt][c], fmaxf(v[nt][c], v[nt][c + 2]));
      } else {
        if (r0 <= lim[nt][c]) mx[nt][c] = fmaxf(mx[nt][c], v[nt][c]);
        if (r0 + 8 <= lim[nt][c]) mx[nt][c] = fmaxf(mx[nt][c], v[nt][c + 2]);
      }
    }
  }
}

// ------------------------------------------------------------------ one page

template <int NT, bool FULL>
__device__ __forceinline__ void page_fast(const uint8_t* data, const uint8_t* scale, int E, int lane,
                                          const QState<NT>& qs, const int (&lim)[NT][2], float (&mx)[NT][2]) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int tile = 0; tile < 8; ++tile) {
    const int r0 = 16 * tile + g;
    const uint32_t m0 = group_multiplier(scale[r0 * kScaleRowBytes + t], E, true);
    const uint32_t m1 = group_multiplier(scale[(r0 + 8) * kScaleRowBytes + t], E, true);
    float acc[NT][4];
    tile_dots<NT>(data, tile, lane, m0, m1, qs, acc);
    tile_max<NT, FULL>(acc, r0, lim, mx);
  }
}

// Pages whose scale bytes span more than kMaxScaleSpan binades: per tile, one pass per band
// [Eb - 24, Eb] of scale bytes (descending), each pass's result scaled to its true value by
// 2^(Eb - 128 + qe) and summed in fp32. `mx` then holds true dot products (before sm_scale).
template <int NT>
__device__ void page_multipass(const uint8_t* data, const uint8_t* scale, int E, int lane, const QState<NT>& qs,
                               const int (&lim)[NT][2], float (&mx)[NT][2]) {
  const int g = lane >> 2, t = lane & 3;
  for (int tile = 0; tile < 8; ++tile) {
    const int r0 = 16 * tile + g;
    const int e0 = scale[r0 * kScaleRowBytes + t];
    const int e1 = scale[(r0 + 8) * kScaleRowBytes + t];
    float total[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) total[nt][i] = 0.f;
    int band = E;
    while (band >= 0) {
      const uint32_t m0 = group_multiplier(e0, band, e0 <= band && e0 >= band - kMaxScaleSpan);
      const uint32_t m1 = group_multiplier(e1, band, e1 <= band && e1 >= band - kMaxScaleSpan);
      float acc[NT][4];
      tile_dots<NT>(data, tile, lane, m0, m1, qs, acc);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) total[nt][i] += ldexpf(acc[nt][i], band - kE8m0Bias - 1 + qs.col_qe[nt][i & 1]);
      const int below = band - kMaxScaleSpan;
      const int cand = max(e0 < below ? e0 : -1, e1 < below ? e1 : -1);
      band = __reduce_max_sync(0xffffffffu, cand + 1) - 1;  // -1: no group left
    }
    tile_max<NT, false>(total, r0, lim, mx);
  }
}

// Scores of one page (in shared memory) for every query vector of the request; lanes 0..3 store.
// Ends with __syncwarp: the page's buffer may be refilled after it returns.
template <int NT>
__device__ __forceinline__ void score_page(const Params& p, const uint8_t* data, int page, int seq_len, int lane,
                                           const QState<NT>& qs, bool in_cache) {
  const int page_start = (page * p.cp_world + p.cp_rank) * kPageTokens;
  int lim[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int c = 0; c < 2; ++c) lim[nt][c] = qs.col_pos[nt][c] - page_start;
  const bool full = page_start + kPageTokens - 1 <= seq_len - p.S;
  const uint8_t* scale = data + kPageDataBytes;
  const uint4 sv = *reinterpret_cast<const uint4*>(scale + 16 * lane);
  const int E = (int)__reduce_max_sync(0xffffffffu, bytes_max(sv));
  const int E_min = (int)__reduce_min_sync(0xffffffffu, bytes_min(sv));

  float mx[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) mx[nt][0] = mx[nt][1] = -INFINITY;
  const bool one_pass = E - E_min <= kMaxScaleSpan;
  if (one_pass) {
    if (full)
      page_fast<NT, true>(data, scale, E, lane, qs, lim, mx);
    else
      page_fast<NT, false>(data, scale, E, lane, qs, lim, mx);
  } else {
    page_multipass<NT>(data, scale, E, lane, qs, lim, mx);
  }
  __syncwarp();  // every lane is done with this buffer

#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float v = mx[nt][c];
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
      if (lane < 4 && qs.col_pos[nt][c] >= 0) {
        v *= p.sm_scale;
        if (one_pass) v = ldexpf(v, E - kE8m0Bias - 1 + qs.col_qe[nt][c]);  // K = A * 2^(E - 128)
        p.out[qs.col_out[nt][c] + page] = in_cache ? v : -INFINITY;
      }
    }
  }
}

// ------------------------------------------------------------------ kernel

template <int NT, bool Q_E4M3>
__global__ void __launch_bounds__(kWarps * 32, ctas_per_sm(NT)) score_decode_mxfp4_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + warp * kStages;
  uint8_t* ring = smem + kBarrierBytes + warp * kStages * kStageBytes;

  // Programmatic dependent launch (a no-op without it): wait for the kernels before this one, then
  // let the next PDL kernel (the selector) be scheduled while this grid runs.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
  const int total = total_pages(p, lane);
  const int warps = gridDim.x * kWarps;
  const int gw = blockIdx.x * kWarps + warp;
  const int start = (int)((int64_t)total * gw / warps);
  const int count = (int)((int64_t)total * (gw + 1) / warps) - start;
  if (count <= 0) return;

  if (lane == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) mbar_init(&bars[s]);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncwarp();
  const uint64_t policy = evict_first_policy();

  Cursor cur;
  locate(p, lane, start, cur.b, cur.page, cur.n);
  auto issue = [&](int stage, int page_id) {
    if (!page_in_cache(p, page_id)) page_id = 0;  // read page 0 instead; the page scores -inf
    if (lane == 0) {
      mbar_expect_tx(&bars[stage], kStageBytes);
      bulk_load(ring + stage * kStageBytes, p.k_data + (int64_t)page_id * p.data_page_stride, kPageDataBytes,
                &bars[stage], policy);
      bulk_load(ring + stage * kStageBytes + kPageDataBytes, p.k_scale + (int64_t)page_id * p.scale_page_stride,
                kPageScaleBytes, &bars[stage], policy);
    }
  };
  int cur_id = p.block_table[(int64_t)cur.b * p.bt_stride + cur.page];
  issue(0, cur_id);
  Cursor nxt = cur;
  advance(p, nxt);
  int next_id = count > 1 ? p.block_table[(int64_t)nxt.b * p.bt_stride + nxt.page] : 0;

  QState<NT> qs;
  int q_b = -1, seq_len = 0;
  for (int i = 0; i < count; ++i) {
    const int stage = i & 1;
    if (i + 1 < count) {
      if (lane == 0) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      issue(stage ^ 1, next_id);
    }
    const int nxt_id = next_id;
    Cursor after = nxt;
    if (i + 2 < count) {
      advance(p, after);
      next_id = p.block_table[(int64_t)after.b * p.bt_stride + after.page];
    }
    if (cur.b != q_b) {
      q_b = cur.b;
      seq_len = p.seq_lens[q_b];
      load_q<NT, Q_E4M3>(p, q_b, seq_len, lane, qs);
    }
    mbar_wait(&bars[stage], (i >> 1) & 1);
    score_page<NT>(p, ring + stage * kStageBytes, cur.page, seq_len, lane, qs, page_in_cache(p, cur_id));
    cur = nxt;
    cur_id = nxt_id;
    nxt = after;
  }
}

}  // namespace m3_mxfp4

#ifndef M3_MXFP4_DEVICE_ONLY
// ------------------------------------------------------------------ host launcher (TVM-FFI)
// Plain CUDA runtime calls and TVM-FFI only (no SGLang headers, whose namespaces differ between
// releases); the stream is the caller's current one, as TVM-FFI hands it over from torch.
#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>

namespace m3_mxfp4 {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) TVM_FFI_THROW(RuntimeError) << what << ": " << cudaGetErrorString(err);
}

template <int NT, bool Q_E4M3>
void launch(const Params& params, int num_sms, bool pdl, DLDevice device) {
  auto kernel = score_decode_mxfp4_kernel<NT, Q_E4M3>;
  // Per device and cheap; allowed during CUDA-graph capture (not a stream operation).
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
             "cudaFuncSetAttribute");
  // Enough warps for one page each, at most a full persistent grid.
  const int64_t pages_bound = (int64_t)params.batch * params.max_block;
  const int64_t ctas = std::min<int64_t>((int64_t)num_sms * ctas_per_sm(NT), (pages_bound + kWarps - 1) / kWarps);
  if (ctas <= 0) return;
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(device.device_type, device.device_id));
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(kWarps * 32);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = pdl ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&config, kernel, params), "score_decode_mxfp4 launch");
}

// Arguments already validated in Python (backends/cuda/__init__.py). `q_bytes` is q viewed as uint8
// ([rows, H, 256] for bf16, [rows, H, 128] for e4m3), so its strides are in bytes.
inline void score_decode_mxfp4(tvm::ffi::TensorView q_bytes, tvm::ffi::TensorView k_data, tvm::ffi::TensorView k_scale,
                               tvm::ffi::TensorView block_table, tvm::ffi::TensorView seq_lens,
                               tvm::ffi::TensorView out, int64_t q_e4m3, int64_t S, int64_t max_block, int64_t cp_rank,
                               int64_t cp_world, double sm_scale, int64_t num_sms, int64_t pdl) {
  Params p;
  p.k_data = static_cast<const uint8_t*>(k_data.data_ptr());
  p.k_scale = static_cast<const uint8_t*>(k_scale.data_ptr());
  p.data_page_stride = k_data.stride(0);
  p.scale_page_stride = k_scale.stride(0);
  p.q = static_cast<const uint8_t*>(q_bytes.data_ptr());
  p.q_row_stride = q_bytes.stride(0);
  p.q_head_stride = q_bytes.stride(1);
  p.block_table = static_cast<const int32_t*>(block_table.data_ptr());
  p.bt_stride = block_table.stride(0);
  p.seq_lens = static_cast<const int32_t*>(seq_lens.data_ptr());
  p.out = static_cast<float*>(out.data_ptr());
  p.out_stride_h = out.stride(0);
  p.out_stride_r = out.stride(1);
  p.batch = static_cast<int>(block_table.size(0));
  p.S = static_cast<int>(S);
  p.H = static_cast<int>(q_bytes.size(1));
  p.max_block = static_cast<int>(max_block);
  p.num_pages = static_cast<int>(k_data.size(0));
  p.cp_rank = static_cast<int>(cp_rank);
  p.cp_world = static_cast<int>(cp_world);
  p.sm_scale = static_cast<float>(sm_scale);
  const int nt = (p.S * p.H + 7) / 8;
  const DLDevice device = q_bytes.device();
  const int sms = static_cast<int>(num_sms);
  const bool use_pdl = pdl != 0;
  switch (nt * 2 + (q_e4m3 != 0 ? 1 : 0)) {
    case 2: launch<1, false>(p, sms, use_pdl, device); break;
    case 3: launch<1, true>(p, sms, use_pdl, device); break;
    case 4: launch<2, false>(p, sms, use_pdl, device); break;
    case 5: launch<2, true>(p, sms, use_pdl, device); break;
    case 6: launch<3, false>(p, sms, use_pdl, device); break;
    case 7: launch<3, true>(p, sms, use_pdl, device); break;
    case 8: launch<4, false>(p, sms, use_pdl, device); break;
    case 9: launch<4, true>(p, sms, use_pdl, device); break;
    default: TVM_FFI_THROW(ValueError) << "S * H must be in [1, 32], got " << p.S * p.H;
  }
}

}  // namespace m3_mxfp4
#endif  // M3_MXFP4_DEVICE_ONLY
