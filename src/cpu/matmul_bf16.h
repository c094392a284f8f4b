// matmul_bf16.h -- the bfloat16 micro-kernel on VDPBF16PS (AVX512-BF16) and its panels of pairs of k
// (Bf16Pairs), the fourth kind of matmul_gemm.h's kernels.  Compiled where the compiler knows AVX512-BF16
// (NEEDLE_BF16_DOT, simd.h); used where the CPU has it and the switch is on (matmul_gemm.h).
#pragma once

#include "common.h"
#include "dtypes.h"
#include "matmul_kernels.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace needle {
namespace cpu {

#ifdef NEEDLE_BF16_DOT
// ---- bfloat16 products with VDPBF16PS (AVX512-BF16) ----------------------------------------------------------
//
// VDPBF16PS (_mm512_dpbf16_ps(acc, a, b)) reads each 32-bit lane of a and b as a pair of bfloat16 values (low
// half first) and adds both products of a lane to that lane's float32 accumulator:
//     acc[l] += a[l].lo * b[l].lo + a[l].hi * b[l].hi        for the 16 lanes l of a zmm register
// One instruction thus does two steps of k for 16 columns: twice the multiply-adds of a float32 FMA, reading
// half the bytes.  The micro-kernel is the AVX-512 float one (a 12 x 32 tile of C in 24 zmm accumulators) with
// k taken two at a time.  For the pair rows q < ceil(kc / 2) of a block, the panels hold 32-bit pairs:
//
//   Ap[q * MR + i] = A[i][2q] | A[i][2q + 1] << 16    (row i of the panel: two neighbours in memory, one load)
//   Bp[q * NR + j] = B[2q][j] | B[2q + 1][j] << 16    (column j: the same two k, from two rows of B)
//
// (the bfloat16 bit patterns, k = 2q in the low half).  Per pair row q the kernel loads Bp's NR = 32 pairs (two
// zmm of 16) and, for each row i, broadcasts the pair Ap[q * MR + i] to all 16 lanes and issues one VDPBF16PS per
// zmm: lane l of acc[i][v] gains A[i][2q] B[2q][16v + l] + A[i][2q + 1] B[2q + 1][16v + l], which are exactly
// the two terms k = 2q, 2q + 1 of C[i][16v + l].  When kc is odd the last pair's upper half is zero in both A
// and B (0 * 0 adds nothing, where 0 * an arbitrary value could be NaN); rows past `rows` and columns past
// `cols` are zero pairs, as in the float panels.  KC = 512 makes a panel as many bytes as the float one; it is
// even, so a pair never straddles two blocks and only the last block of an odd n has an odd kc.
//
// How the results differ from the widening kernels (both accumulate in float32; the difference is within the
// float32-accumulation error, n * 2^-24 * sum |a_k b_k| for n terms):
//   - order: a product of two bfloat16 values is exact in float32 in both paths, but VDPBF16PS adds the two
//     products of a pair to the accumulator in its own order, each addition rounded (Intel documents the upper
//     one, k = 2q + 1, first; measured the same on AMD Zen 4), where the widening kernel adds one k after the other;
//   - denormals: VDPBF16PS treats denormal inputs as zero and flushes denormal results to zero whatever MXCSR
//     says (the widening path keeps them).  Only magnitudes below 2^-126 (~1.2e-38) are affected.
// Like the float kernels, every element of C is summed in one fixed order, so results do not depend on threads.
//
// A bfloat16 out: when n <= KC the whole sum is in the registers at the end (one k block, no float32 partial
// sums to keep between blocks), so the micro-kernel rounds it to bfloat16 there and writes out directly
// (store_tile_bf16): no float32 temporary and no rounding pass over it, the same bits as rounding afterwards.
#define NEEDLE_BF16_TARGET __attribute__((target("avx512f,avx512vl,avx512bw,avx512bf16,avx2,fma")))
constexpr int BF16_MR = 12, BF16_NR = 32;

// Ap[q * MR + i] = the pair (A[r0 + i][c0 + 2q], A[r0 + i][c0 + 2q + 1]) for q < ceil(kc / 2), i < MR.
NEEDLE_BF16_TARGET static void pack_a_pairs(const bfloat16_t* A, int64_t lda, int64_t r0, int64_t rows,
                                            int64_t c0, int64_t kc, uint32_t* Ap) {
  const int64_t full = kc / 2, depth = (kc + 1) / 2;  // pairs with both halves in the block; all pairs
  for (int i = 0; i < BF16_MR; ++i) {
    uint32_t* dst = Ap + i;
    if (i >= rows) {
      for (int64_t q = 0; q < depth; ++q) dst[q * BF16_MR] = 0;
      continue;
    }
    const bfloat16_t* row = A + (r0 + i) * lda + c0;
    for (int64_t q = 0; q < full; ++q) std::memcpy(&dst[q * BF16_MR], row + 2 * q, 4);  // (little-endian)
    if (kc % 2) dst[full * BF16_MR] = row[kc - 1].bits;
  }
}

// Bp[q * NR + j] = the pair (B[r0 + 2q][c0 + j], B[r0 + 2q + 1][c0 + j]) for q < ceil(kc / 2), j < NR.
NEEDLE_BF16_TARGET static void pack_b_pairs(const bfloat16_t* B, int64_t ldb, int64_t r0, int64_t kc, int64_t c0,
                                            int64_t cols, uint32_t* Bp) {
  for (int64_t q = 0; q < (kc + 1) / 2; ++q) {
    const bfloat16_t* lo = B + (r0 + 2 * q) * ldb + c0;
    uint32_t* dst = Bp + q * BF16_NR;
    if (2 * q + 1 < kc) {
      const bfloat16_t* hi = lo + ldb;
      for (int64_t j = 0; j < cols; ++j) dst[j] = uint32_t(lo[j].bits) | uint32_t(hi[j].bits) << 16;
    } else {
      for (int64_t j = 0; j < cols; ++j) dst[j] = lo[j].bits;
    }
    for (int64_t j = cols; j < BF16_NR; ++j) dst[j] = 0;
  }
}

// Rounds the tile to bfloat16 exactly as from_float<bfloat16_t> does (nearest, ties to even; a NaN stays a quiet
// NaN), 16 lanes at a time, and writes its mr x nr part to C (bfloat16, rows ldc apart).
template <int MR, int NV>
static inline __attribute__((always_inline)) void store_tile_bf16(v16sf (&acc)[MR][NV], bfloat16_t* C,
                                                                   int64_t ldc, int64_t mr, int64_t nr) {
  typedef uint32_t v16su __attribute__((vector_size(64)));
  typedef uint16_t v16hu __attribute__((vector_size(32)));
  for (int64_t i = 0; i < mr; ++i)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const v16su u = (v16su)acc[i][v];
      const v16su rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      const v16su quiet_nan = (u >> 16) | 0x0040u;
      const v16hu h = __builtin_convertvector((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded, v16hu);
      const int64_t cols = std::min<int64_t>(16, nr - 16 * v);
      if (cols == 16) {
        __builtin_memcpy(C + i * ldc + 16 * v, &h, sizeof(h));
      } else {
        for (int64_t j = 0; j < cols; ++j) C[i * ldc + 16 * v + j].bits = h[j];
      }
    }
}

// C[i * ldc + j] (+)= sum_q dot(Ap[q * MR + i], Bp[q * NR + j])  for i < mr, j < nr, over `depth` pair rows.
// O is float, or bfloat16_t for a product of one k block (accumulate is then false).
template <class O>
NEEDLE_BF16_TARGET static void ukernel_avx512_bf16(int64_t depth, const uint32_t* Ap, const uint32_t* Bp, O* C,
                                                   int64_t ldc, int64_t mr, int64_t nr, bool accumulate) {
  constexpr int NV = BF16_NR / 16;
  v16sf acc[BF16_MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < BF16_MR; ++i)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[i][v] = v16sf{};
  for (int64_t q = 0; q < depth; ++q) {
    __m512bh b[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(Bp + 16 * v);
#pragma GCC unroll 16
    for (int i = 0; i < BF16_MR; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(Ap[i]));
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[i][v] = (v16sf)_mm512_dpbf16_ps((__m512)acc[i][v], a, b[v]);
    }
    Ap += BF16_MR;
    Bp += BF16_NR;
  }
  if constexpr (std::is_same<O, bfloat16_t>::value) {
    store_tile_bf16<BF16_MR, NV>(acc, C, ldc, mr, nr);
  } else {
    store_tile<v16sf, BF16_MR, NV>(acc, C, ldc, mr, nr, accumulate);
  }
}

struct Bf16Pairs {
  using input_t = bfloat16_t;
  using packed_t = uint32_t;
  static constexpr int MR = BF16_MR, NR = BF16_NR;
  static constexpr bool TRANS_A = false, TRANS_B = false;
  static constexpr int64_t KC = BF16_DOT_KC;
  static int64_t depth(int64_t kc) { return (kc + 1) / 2; }
  static void pack_a(const bfloat16_t* A, int64_t lda, int64_t r0, int64_t rows, int64_t c0, int64_t kc,
                     packed_t* Ap) {
    pack_a_pairs(A, lda, r0, rows, c0, kc, Ap);
  }
  static void pack_b(const bfloat16_t* B, int64_t ldb, int64_t r0, int64_t kc, int64_t c0, int64_t cols,
                     packed_t* Bp) {
    pack_b_pairs(B, ldb, r0, kc, c0, cols, Bp);
  }
  template <class O>
  static void kernel(int64_t depth, const packed_t* Ap, const packed_t* Bp, O* C, int64_t ldc, int64_t mr,
                     int64_t nr, bool accumulate) {
    ukernel_avx512_bf16<O>(depth, Ap, Bp, C, ldc, mr, nr, accumulate);
  }
};
#endif  // NEEDLE_BF16_DOT

}  // namespace cpu
}  // namespace needle
