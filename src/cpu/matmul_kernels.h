// matmul_kernels.h -- the float32 matmul micro-kernels (an MR x NR tile of C in vector registers: portable
// 128-bit, AVX2 and AVX-512), the packing of A and B into the panels they read (FloatPanels, also from
// transposed operands, widening 16-bit ones) and the packing buffers (Scratch).  matmul_gemm.h describes the
// whole GEMM and drives these.
#pragma once

#include "common.h"
#include "dtypes.h"
#include "simd.h"

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace needle {
namespace cpu {

// C[i * ldc + j] (+)= sum_k Ap[k * MR + i] * Bp[k * NR + j]  for i < mr, j < nr
typedef void (*ukernel_fn)(int64_t kc, const scalar_t* Ap, const scalar_t* Bp, scalar_t* C, int64_t ldc,
                           int64_t mr, int64_t nr, bool accumulate);

// Writes the MR x (NV * VL) tile acc into C (or adds it to C when `accumulate`): whole vectors for a full tile,
// element by element for an edge tile, of which only mr x nr belong to C.
template <class V, int MR, int NV>
static inline __attribute__((always_inline)) void store_tile(V (&acc)[MR][NV], scalar_t* __restrict C,
                                                              int64_t ldc, int64_t mr, int64_t nr, bool accumulate) {
  constexpr int VL = sizeof(V) / sizeof(scalar_t);
  constexpr int NR = NV * VL;
  if (mr == MR && nr == NR) {
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) {
        scalar_t* c = C + i * ldc + j * VL;
        if (accumulate) {
          V old;
          __builtin_memcpy(&old, c, sizeof(V));
          acc[i][j] += old;
        }
        __builtin_memcpy(c, &acc[i][j], sizeof(V));
      }
  } else {  // edge tile: only mr x nr of the computed tile belong to C
    scalar_t tile[MR * NR];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) __builtin_memcpy(tile + i * NR + j * VL, &acc[i][j], sizeof(V));
    for (int64_t i = 0; i < mr; ++i)
      for (int64_t j = 0; j < nr; ++j) {
        scalar_t& c = C[i * ldc + j];
        c = (accumulate ? c : 0.0f) + tile[i * NR + j];
      }
  }
}

template <class V, int MR, int NV>
static inline __attribute__((always_inline)) void ukernel_body(int64_t kc, const scalar_t* __restrict Ap,
                                                                const scalar_t* __restrict Bp,
                                                                scalar_t* __restrict C, int64_t ldc, int64_t mr,
                                                                int64_t nr, bool accumulate) {
  constexpr int VL = sizeof(V) / sizeof(scalar_t);
  constexpr int NR = NV * VL;
  V acc[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) acc[i][j] = V{};
  for (int64_t k = 0; k < kc; ++k) {
    V b[NV];
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) __builtin_memcpy(&b[j], Bp + j * VL, sizeof(V));
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const scalar_t a = Ap[i];
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[i][j] += a * b[j];
    }
    Ap += MR;
    Bp += NR;
  }
  store_tile<V, MR, NV>(acc, C, ldc, mr, nr, accumulate);
}

constexpr int GENERIC_MR = 6, GENERIC_NR = 8;
static void ukernel_generic(int64_t kc, const scalar_t* Ap, const scalar_t* Bp, scalar_t* C, int64_t ldc,
                            int64_t mr, int64_t nr, bool accumulate) {
  ukernel_body<v4sf, GENERIC_MR, GENERIC_NR / 4>(kc, Ap, Bp, C, ldc, mr, nr, accumulate);
}

#ifdef NEEDLE_X86_DISPATCH
constexpr int AVX2_MR = 6, AVX2_NR = 16;
constexpr int AVX512_MR = 12, AVX512_NR = 32;
__attribute__((target("avx2,fma"))) static void ukernel_avx2(int64_t kc, const scalar_t* Ap, const scalar_t* Bp,
                                                             scalar_t* C, int64_t ldc, int64_t mr, int64_t nr,
                                                             bool accumulate) {
  ukernel_body<v8sf, AVX2_MR, AVX2_NR / 8>(kc, Ap, Bp, C, ldc, mr, nr, accumulate);
}
__attribute__((target("avx512f,avx512vl,avx2,fma"))) static void ukernel_avx512(
    int64_t kc, const scalar_t* Ap, const scalar_t* Bp, scalar_t* C, int64_t ldc, int64_t mr, int64_t nr,
    bool accumulate) {
  ukernel_body<v16sf, AVX512_MR, AVX512_NR / 16>(kc, Ap, Bp, C, ldc, mr, nr, accumulate);
}
#endif

// A grow-only, 64-byte aligned scratch buffer, thread_local to the calling thread and reused across calls so
// that packing never pays for fresh pages.  Not counted in memory_stats (that counts Arrays only).
class Scratch {
 public:
  ~Scratch() { std::free(ptr_); }
  // Room for n elements of T (the packed panels' element type); nullptr if the allocation failed.
  template <class T>
  T* get(size_t n) {
    const size_t bytes = (n * sizeof(T) + ALIGNMENT - 1) / ALIGNMENT * ALIGNMENT;
    if (bytes > cap_) {
      std::free(ptr_);
      ptr_ = std::aligned_alloc(ALIGNMENT, bytes);
      cap_ = ptr_ == nullptr ? 0 : bytes;
    }
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  size_t cap_ = 0;  // bytes
};

constexpr int64_t MC_MAX = 96;  // rows of A per packed block (MC x KC floats: 96 KiB, in L2)
constexpr int64_t NC = 3072;  // columns of B per packed block (KC x NC floats: 3 MiB, in L2/L3)
constexpr int64_t BF16_DOT_KC = 512;  // KC of the bfloat16 dot-product kernel (the same bytes as the float KC)

static inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Ap[k][i] = A[r0 + i][c0 + k]: one MR-row micro-panel of A (rows past `rows` are zero).  Packing is also where
// 16-bit operands are widened to float32: the micro-kernel only ever sees float panels.
template <int MR, class T>
static void pack_a_panel(const T* A, int64_t lda, int64_t r0, int64_t rows, int64_t c0, int64_t kc,
                         scalar_t* Ap) {
  const T* src = A + r0 * lda + c0;
  if (rows == MR) {
    for (int64_t k = 0; k < kc; ++k)
      for (int i = 0; i < MR; ++i) Ap[k * MR + i] = to_float(src[i * lda + k]);
  } else {
    for (int64_t k = 0; k < kc; ++k)
      for (int i = 0; i < MR; ++i) Ap[k * MR + i] = i < rows ? to_float(src[i * lda + k]) : 0.0f;
  }
}

// Bp[k][j] = B[r0 + k][c0 + j]: one NR-column micro-panel of B (columns past `cols` are zero).
template <int NR, class T>
static void pack_b_panel(const T* B, int64_t ldb, int64_t r0, int64_t kc, int64_t c0, int64_t cols,
                         scalar_t* Bp) {
  const T* src = B + r0 * ldb + c0;
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (std::is_same<T, float>::value) {
      std::memcpy(Bp + k * NR, src + k * ldb, static_cast<size_t>(cols) * ELEM_SIZE);
    } else {
      for (int64_t j = 0; j < cols; ++j) Bp[k * NR + j] = to_float(src[k * ldb + j]);
    }
    for (int64_t j = cols; j < NR; ++j) Bp[k * NR + j] = 0.0f;
  }
}

// The same panels from a transposed operand, read where it is: A given as At (n x m) row-major, so that
// A[r][c] = At[c * lda + r] (lda = m), and B as Bt (p x n), B[r][c] = Bt[c * ldb + r] (ldb = n).  The panels hold
// the same numbers in the same order as from a transposed copy, so the product's bits are the same, without the
// copy (a Linear's gradient multiplies by W^T and x^T).
template <int MR, class T>
static void pack_a_panel_t(const T* At, int64_t lda, int64_t r0, int64_t rows, int64_t c0, int64_t kc,
                           scalar_t* Ap) {
  for (int64_t k = 0; k < kc; ++k) {
    const T* src = At + (c0 + k) * lda + r0;  // A[r0 .. r0 + rows][c0 + k]: contiguous in At
    for (int i = 0; i < MR; ++i) Ap[k * MR + i] = i < rows ? to_float(src[i]) : 0.0f;
  }
}

template <int NR, class T>
static void pack_b_panel_t(const T* Bt, int64_t ldb, int64_t r0, int64_t kc, int64_t c0, int64_t cols,
                           scalar_t* Bp) {
  for (int64_t j = 0; j < NR; ++j) {
    const T* src = Bt + (c0 + j) * ldb + r0;  // B[r0 .. r0 + kc][c0 + j]: contiguous in Bt
    for (int64_t k = 0; k < kc; ++k) Bp[k * NR + j] = j < cols ? to_float(src[k]) : 0.0f;
  }
}

// The panels gemm_packed works on, and the micro-kernel that reads them.  Here float panels (into which float32
// and 16-bit operands alike are packed, widened) read by the float micro-kernel UK; Bf16Pairs (matmul_bf16.h) is the
// other kind.  A panel holding kc steps of k has depth(kc) rows: MR (or NR) packed values each.
template <int MR_, int NR_, ukernel_fn UK, class T, bool TRANS_A_ = false, bool TRANS_B_ = false>
struct FloatPanels {
  using input_t = T;
  using packed_t = scalar_t;
  static constexpr int MR = MR_, NR = NR_;
  static constexpr bool TRANS_A = TRANS_A_, TRANS_B = TRANS_B_;  // operands given transposed (pack_*_panel_t)
  static constexpr int64_t KC = 256;  // depth of one packed block: a KC x NR B micro-panel (32 KiB at NR=32), L1
  static int64_t depth(int64_t kc) { return kc; }
  static void pack_a(const T* A, int64_t lda, int64_t r0, int64_t rows, int64_t c0, int64_t kc, packed_t* Ap) {
    if constexpr (TRANS_A) {
      pack_a_panel_t<MR>(A, lda, r0, rows, c0, kc, Ap);
    } else {
      pack_a_panel<MR>(A, lda, r0, rows, c0, kc, Ap);
    }
  }
  static void pack_b(const T* B, int64_t ldb, int64_t r0, int64_t kc, int64_t c0, int64_t cols, packed_t* Bp) {
    if constexpr (TRANS_B) {
      pack_b_panel_t<NR>(B, ldb, r0, kc, c0, cols, Bp);
    } else {
      pack_b_panel<NR>(B, ldb, r0, kc, c0, cols, Bp);
    }
  }
  static void kernel(int64_t depth, const packed_t* Ap, const packed_t* Bp, scalar_t* C, int64_t ldc, int64_t mr,
                     int64_t nr, bool accumulate) {
    UK(depth, Ap, Bp, C, ldc, mr, nr, accumulate);
  }
};

}  // namespace cpu
}  // namespace needle
