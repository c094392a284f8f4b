// matmul_gemm.h -- the GEMM on raw pointers: the packed, cache-blocked driver (gemm_packed) over the
// micro-kernels of matmul_kernels.h and matmul_bf16.h, the unpacked paths for small products (gemm_small,
// gemv), the table of kernels and the choice among them (set_matmul_kernel, set_matmul_bf16_dot), and gemm,
// which picks the path for a shape and dtype.  Attention (attention.h) calls gemm on its tiles.
//
// C (m x p) = A (m x n) @ B (n x p).  The classic Goto/BLIS scheme:
//
//   for jc in [0, p) step NC                      columns of C and B  (B block KC x NC lives in L3/L2)
//     for pc in [0, n) step KC                    the shared dimension
//       pack B[pc:pc+KC, jc:jc+NC] into micro-panels of NR columns:   Bp[panel][k][0..NR)   (all threads)
//       for ic in [0, m) step MC      (OpenMP)    row blocks of C and A, one thread each
//         pack A[ic:ic+MC, pc:pc+KC] into micro-panels of MR rows:    Ap[panel][k][0..MR)   (thread-local)
//         for jr in [0, NC) step NR               one B micro-panel (KC x NR) stays in L1 ...
//           for ir in [0, MC) step MR             ... while the A micro-panels stream from L2
//             micro-kernel: C[ir:ir+MR, jr:jr+NR] (+)= Ap[ir] @ Bp[jr]  (MR x NR sums held in registers)
//
// Packing copies each operand once per block into the exact order the micro-kernel reads it (unit stride,
// zero-padded to whole MR / NR panels, so the micro-kernel never branches on edges in its k loop).  The first
// KC block stores into C, later ones accumulate.  Threads (OpenMP, OMP_NUM_THREADS) pack the shared B block
// together and then take row blocks (about 4 per thread, so small m still splits evenly); the only
// synchronisation is the two barriers around each B block.  Every element of C is produced by one thread with
// the same order of additions, so results do not depend on the thread count.
//
// The micro-kernel keeps an MR x NR tile of C in vector registers (GCC vector extensions, no intrinsics): per k
// it loads NR/VL vectors of B and, for each of the MR rows, broadcasts one A value and does NR/VL FMAs.
// Three builds of it exist: AVX-512 (12 x 32, 24 zmm accumulators), AVX2+FMA (6 x 16, 12 ymm accumulators) and
// a portable 128-bit one (6 x 8).  The AVX ones are compiled with per-function `target` attributes and chosen at
// run time with __builtin_cpu_supports (which also checks that the OS saves the registers), so the module
// itself needs no -march flag and runs on any x86-64 CPU.  NEEDLE_CPU_MATMUL_KERNEL=avx512|avx2|generic forces
// a choice (for tests and benchmarks; set_matmul_kernel(name) from Python).
//
// 16-bit operands are widened to float32 while they are packed, so the same micro-kernels serve them.  The one
// exception: on CPUs with AVX512-BF16, bfloat16 products keep their 16 bits through packing and use a
// fourth micro-kernel built on the VDPBF16PS dot-product instruction (twice the multiply-adds per instruction;
// see matmul_bf16.h).  It is used while the avx512 kernel is selected and the switch is on: on by default, off
// with NEEDLE_CPU_MATMUL_BF16_DOT=0 or set_matmul_bf16_dot(False); matmul_bf16_dot() reads the switch.  Off (or
// with another kernel selected), bfloat16 is widened like float16.
#pragma once

#include "array.h"
#include "common.h"
#include "dtypes.h"
#include "matmul_bf16.h"
#include "matmul_kernels.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

namespace needle {
namespace cpu {

// The calling thread's buffers for packed A panels and for the packed B block.
static Scratch& a_scratch() {
  static thread_local Scratch scratch;
  return scratch;
}
static Scratch& b_scratch() {
  static thread_local Scratch scratch;
  return scratch;
}

// C (m x p) = A (m x n) @ B (n x p), all compact row-major; A and B of P's input type, C float32 (O = float) or,
// for Bf16Pairs with n <= KC, bfloat16.  P says how the panels are packed and which micro-kernel reads them
// (FloatPanels, Bf16Pairs).  accumulate: C += A @ B (the first KC block adds to C instead of storing; float32 C).
template <class P, class O = scalar_t>
static void gemm_packed(const typename P::input_t* A, const typename P::input_t* B, O* C, int64_t m, int64_t n,
                        int64_t p, int nthreads, bool accumulate) {
  using packed_t = typename P::packed_t;
  constexpr int64_t MR = P::MR, NR = P::NR, KC = P::KC;
  // Row blocks: about 4 per thread for balance, a multiple of MR, at most MC_MAX.
  const int64_t mc_max = std::min(MC_MAX, ceil_div(ceil_div(m, 4 * nthreads), MR) * MR);
  const int64_t nblocks = ceil_div(m, mc_max);
  const int64_t nc_max = std::min(NC, ceil_div(p, NR) * NR);
  const int64_t depth_max = P::depth(std::min(KC, n));
  // The packed B block is shared by the threads (the calling thread's buffer); each thread packs its own A.
  packed_t* Bp = b_scratch().get<packed_t>(static_cast<size_t>(depth_max * nc_max));
  if (Bp == nullptr) throw std::bad_alloc();

  // Row pitches of A and B as stored: (m x n) and (n x p) row-major, or their transposes.
  const int64_t lda = P::TRANS_A ? m : n, ldb = P::TRANS_B ? n : p;
  // The two steps of each (jc, pc) block: pack B micro-panel jp, and compute row block blk of C with Ap.
  auto pack_b = [&](int64_t jc, int64_t nc, int64_t pc, int64_t kc, int64_t jp) {
    P::pack_b(B, ldb, pc, kc, jc + jp * NR, std::min<int64_t>(NR, nc - jp * NR), Bp + jp * NR * P::depth(kc));
  };
  auto row_block = [&](packed_t* Ap, int64_t jc, int64_t nc, int64_t pc, int64_t kc, int64_t blk) {
    const int64_t ic = blk * mc_max, mc = std::min(mc_max, m - ic), depth = P::depth(kc);
    for (int64_t ir = 0; ir < mc; ir += MR)
      P::pack_a(A, lda, ic + ir, std::min<int64_t>(MR, mc - ir), pc, kc, Ap + ir * depth);
    for (int64_t jr = 0; jr < nc; jr += NR)
      for (int64_t ir = 0; ir < mc; ir += MR)
        P::kernel(depth, Ap + ir * depth, Bp + jr * depth, C + (ic + ir) * p + jc + jr, p,
                  std::min<int64_t>(MR, mc - ir), std::min<int64_t>(NR, nc - jr), accumulate || pc > 0);
  };

  if (nthreads == 1) {  // no OpenMP region at all: even an inactive one costs about as much as a small product
    packed_t* Ap = a_scratch().get<packed_t>(static_cast<size_t>(mc_max * depth_max));
    if (Ap == nullptr) throw std::bad_alloc();
    for (int64_t jc = 0; jc < p; jc += NC) {
      const int64_t nc = std::min(NC, p - jc);
      for (int64_t pc = 0; pc < n; pc += KC) {
        const int64_t kc = std::min(KC, n - pc);
        for (int64_t jp = 0; jp < ceil_div(nc, NR); ++jp) pack_b(jc, nc, pc, kc, jp);
        for (int64_t blk = 0; blk < nblocks; ++blk) row_block(Ap, jc, nc, pc, kc, blk);
      }
    }
    return;
  }

  int failed = 0;
#pragma omp parallel num_threads(nthreads)
  {
    packed_t* Ap = a_scratch().get<packed_t>(static_cast<size_t>(mc_max * depth_max));
    if (Ap == nullptr) {
#pragma omp atomic write
      failed = 1;
    }
    for (int64_t jc = 0; jc < p; jc += NC) {
      const int64_t nc = std::min(NC, p - jc);
      const int64_t n_jr = ceil_div(nc, NR);
      for (int64_t pc = 0; pc < n; pc += KC) {
        const int64_t kc = std::min(KC, n - pc);
#pragma omp for schedule(static)
        for (int64_t jp = 0; jp < n_jr; ++jp) pack_b(jc, nc, pc, kc, jp);
        // (barrier: B is packed before anyone uses it)  Row blocks go to whichever thread is free, so the
        // threads stay balanced even when another process shares a core.
#pragma omp for schedule(dynamic, 1)
        for (int64_t blk = 0; blk < nblocks; ++blk) {
          if (Ap != nullptr) row_block(Ap, jc, nc, pc, kc, blk);
        }
        // (barrier: nobody still reads Bp when it is packed again)
      }
    }
  }
  if (failed) throw std::bad_alloc();
}

// Small products, and those with very few rows: no packing.  Columns are taken in chunks of JB so that the
// rows of C being summed stay in L1 while B's chunk is read once per group of up to 4 rows.
static void gemm_small(const scalar_t* __restrict A, const scalar_t* __restrict B, scalar_t* __restrict C,
                       int64_t m, int64_t n, int64_t p, int nthreads) {
  constexpr int64_t JB = 512, IB = 4;
  const int64_t chunks = ceil_div(p, JB);
  auto chunk = [&](int64_t jb) {
    const int64_t j0 = jb * JB, len = std::min(JB, p - j0);
    for (int64_t i0 = 0; i0 < m; i0 += IB) {
      const int64_t rows = std::min(IB, m - i0);
      for (int64_t i = i0; i < i0 + rows; ++i) std::fill(C + i * p + j0, C + i * p + j0 + len, 0.0f);
      for (int64_t k = 0; k < n; ++k) {
        const scalar_t* b = B + k * p + j0;
        for (int64_t i = i0; i < i0 + rows; ++i) {
          const scalar_t a = A[i * n + k];
          scalar_t* c = C + i * p + j0;
          for (int64_t j = 0; j < len; ++j) c[j] += a * b[j];
        }
      }
    }
  };
  if (nthreads > 1 && chunks > 1) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t jb = 0; jb < chunks; ++jb) chunk(jb);
  } else {  // no OpenMP region at all: even an inactive one costs ~1 us, more than a small product
    for (int64_t jb = 0; jb < chunks; ++jb) chunk(jb);
  }
}

// p == 1: one dot product per row of A.
static void gemv(const scalar_t* A, const scalar_t* x, scalar_t* y, int64_t m, int64_t n, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t i = 0; i < m; ++i) {
    const scalar_t* a = A + i * n;
    scalar_t s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < n; ++k) s += a[k] * x[k];
    y[i] = s;
  }
}

template <class T, class O = scalar_t>
using gemm_fn = void (*)(const T*, const T*, O*, int64_t, int64_t, int64_t, int, bool);

// One micro-kernel, and the packed GEMM built on it for each storage type of A and B; the AVX-512 one also has
// the bfloat16 dot-product GEMM (Bf16Pairs), used for bfloat16 products when g_bf16_dot is on.
struct MatmulKernel {
  const char* name;
  gemm_fn<float> gemm;
  gemm_fn<float> gemm_ta, gemm_tb, gemm_tab;  // float32 with A, B or both given transposed
  gemm_fn<bfloat16_t> gemm_bf16;
  gemm_fn<half_t> gemm_f16;
  int mr, nr;
  gemm_fn<bfloat16_t> gemm_bf16_dot;  // nullptr: none
  gemm_fn<bfloat16_t, bfloat16_t> gemm_bf16_dot_to_bf16;  // the same with bfloat16 out, for n <= BF16_DOT_KC
};

#define NEEDLE_MATMUL_KERNEL(NAME, MR, NR, UK, BF16_DOT, BF16_DOT_TO_BF16)                                \
  {NAME, gemm_packed<FloatPanels<MR, NR, UK, float>>, gemm_packed<FloatPanels<MR, NR, UK, float, true, false>>, \
   gemm_packed<FloatPanels<MR, NR, UK, float, false, true>>, gemm_packed<FloatPanels<MR, NR, UK, float, true, true>>, \
   gemm_packed<FloatPanels<MR, NR, UK, bfloat16_t>>, gemm_packed<FloatPanels<MR, NR, UK, half_t>>, MR, NR,     \
   BF16_DOT, BF16_DOT_TO_BF16}
static const MatmulKernel KERNEL_GENERIC =
    NEEDLE_MATMUL_KERNEL("generic", GENERIC_MR, GENERIC_NR, ukernel_generic, nullptr, nullptr);
#ifdef NEEDLE_X86_DISPATCH
static const MatmulKernel KERNEL_AVX2 =
    NEEDLE_MATMUL_KERNEL("avx2", AVX2_MR, AVX2_NR, ukernel_avx2, nullptr, nullptr);
#ifdef NEEDLE_BF16_DOT
static const MatmulKernel KERNEL_AVX512 = NEEDLE_MATMUL_KERNEL("avx512", AVX512_MR, AVX512_NR, ukernel_avx512,
                                                               gemm_packed<Bf16Pairs>,
                                                               (gemm_packed<Bf16Pairs, bfloat16_t>));
#else
static const MatmulKernel KERNEL_AVX512 =
    NEEDLE_MATMUL_KERNEL("avx512", AVX512_MR, AVX512_NR, ukernel_avx512, nullptr, nullptr);
#endif
#endif

static const MatmulKernel* kernel_by_name(const std::string& name) {
  if (!cpu_has(name.c_str())) return nullptr;
#ifdef NEEDLE_X86_DISPATCH
  if (name == "avx512") return &KERNEL_AVX512;
  if (name == "avx2") return &KERNEL_AVX2;
#endif
  return &KERNEL_GENERIC;
}

static const MatmulKernel* g_kernel = nullptr;  // chosen at import

static void choose_kernel() {
  const char* env = std::getenv("NEEDLE_CPU_MATMUL_KERNEL");
  if (env != nullptr && *env != '\0') {
    g_kernel = kernel_by_name(env);
    if (g_kernel != nullptr) return;
  }
  for (const char* name : {"avx512", "avx2", "generic"}) {
    g_kernel = kernel_by_name(name);
    if (g_kernel != nullptr) return;
  }
}

static void set_matmul_kernel(const std::string& name) {
  const MatmulKernel* k = kernel_by_name(name);
  if (k == nullptr) fail("set_matmul_kernel: '" + name + "' is unknown or not supported by this CPU");
  g_kernel = k;
}

// Whether this CPU (and OS) runs the bfloat16 dot-product kernel (VDPBF16PS), and the switch g_bf16_dot: on at
// import where the CPU has it, unless NEEDLE_CPU_MATMUL_BF16_DOT=0; set_matmul_bf16_dot sets it.  The kernel is
// only used while the avx512 kernel is the selected one: with set_matmul_kernel("avx2"), say, bfloat16 goes
// through the avx2 kernel, widened, whatever the switch says.
static bool cpu_has_bf16_dot() {
#ifdef NEEDLE_BF16_DOT
  __builtin_cpu_init();
  return cpu_has("avx512") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

static bool g_bf16_dot = false;

static void choose_bf16_dot() {
  const char* env = std::getenv("NEEDLE_CPU_MATMUL_BF16_DOT");
  g_bf16_dot = cpu_has_bf16_dot() && !(env != nullptr && std::strcmp(env, "0") == 0);
}

// Whether bfloat16 products take the dot-product kernel now: switched on, and the avx512 kernel selected.
static bool use_bf16_dot() { return g_bf16_dot && g_kernel->gemm_bf16_dot != nullptr; }

static void set_matmul_bf16_dot(bool enabled) {
  if (enabled && !cpu_has_bf16_dot())
    fail("set_matmul_bf16_dot: this CPU (or this build) has no AVX512-BF16 dot-product kernel");
  g_bf16_dot = enabled;
}

// Whether a float32 product of this shape takes the packed kernel (else gemv or gemm_small, unpacked).
static bool uses_packed_kernel(int64_t m, int64_t n, int64_t p) {
  const double flops = 2.0 * double(m) * double(n) * double(p);
  return p != 1 && !(flops < 2.0 * 8 * 8 * 8 || (m < g_kernel->mr / 2 && m < p));
}

// C (m x p) = A (m x n) @ B (n x p) for m, n, p > 0 on `nthreads` threads, with the kernel that suits the shape.
static void gemm(const scalar_t* A, const scalar_t* B, scalar_t* C, int64_t m, int64_t n, int64_t p,
                 int nthreads) {
  if (p == 1) {
    gemv(A, B, C, m, n, nthreads);
  } else if (!uses_packed_kernel(m, n, p)) {
    gemm_small(A, B, C, m, n, p, nthreads);
  } else {
    g_kernel->gemm(A, B, C, m, n, p, nthreads, false);
  }
}

// 16-bit A and B: always a packed kernel (no unpacked small-matrix paths): for bfloat16 the dot-product one when
// it is on, else the selected kernel, which widens them while packing.
static void gemm(const bfloat16_t* A, const bfloat16_t* B, scalar_t* C, int64_t m, int64_t n, int64_t p,
                 int nthreads) {
  if (use_bf16_dot()) {
    g_kernel->gemm_bf16_dot(A, B, C, m, n, p, nthreads, false);
  } else {
    g_kernel->gemm_bf16(A, B, C, m, n, p, nthreads, false);
  }
}
static void gemm(const half_t* A, const half_t* B, scalar_t* C, int64_t m, int64_t n, int64_t p, int nthreads) {
  g_kernel->gemm_f16(A, B, C, m, n, p, nthreads, false);
}

// A bfloat16 product with a bfloat16 out is rounded in the dot-product kernel's registers and written to out
// directly (store_tile_bf16) when the kernel is in use and n <= its KC; otherwise it accumulates in a float32
// Accumulator that is rounded afterwards.  The bits are the same either way.
static bool bf16_out_direct(DType dt, const Array& out, int64_t n) {
  return dt == DType::bf16 && out.dtype == DType::bf16 && use_bf16_dot() && n <= BF16_DOT_KC;
}
static void gemm(const bfloat16_t* A, const bfloat16_t* B, bfloat16_t* C, int64_t m, int64_t n, int64_t p,
                 int nthreads) {
  g_kernel->gemm_bf16_dot_to_bf16(A, B, C, m, n, p, nthreads, false);
}

}  // namespace cpu
}  // namespace needle
