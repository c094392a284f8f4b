// vector_math.h -- exp, log, tanh, row sums and row maxima written once over a GCC vector type F (4, 8 or
// 16 floats; no intrinsics), compiled once per instruction set and picked at import (g_vector).
//
// std::exp / std::log / std::tanh are scalar library calls, which no compiler vectorizes.  These are the
// Cephes single-precision algorithms (range reduction + a short polynomial; tanh with its own fits), rewritten
// without branches so one body serves 4, 8 or 16 lanes: special cases are computed for every lane and chosen
// with vector selects (`mask ? a : b`).  Measured against float64 references over their whole ranges, exp is
// within 1.01 ulp, log within 0.83 ulp and tanh within 1.10 ulp of the exact result (numpy's float32
// functions: 2.4, 3.8 and 1.4).
// Special values follow numpy: exp(-inf) = 0, exp(x > 88.72...) = inf, log(0) = -inf, log(x < 0) = NaN,
// tanh(+-inf) = +-1 exactly, NaN in -> NaN out; denormal inputs and results are handled, not flushed.
//
// Each function takes its argument by reference and overwrites it: passing 32- or 64-byte vectors by value
// from code not compiled for AVX would change the calling convention (GCC's -Wpsabi warning).
#pragma once

#include "common.h"
#include "simd.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

namespace needle {
namespace cpu {

// The int32 vector with as many lanes as F: the result type of F's comparisons and the type its bits are
// reinterpreted as (a cast between vector types of one size reinterprets the bits).
template <class F>
struct IntVec {
  typedef int32_t type __attribute__((vector_size(sizeof(F))));
};

#define NEEDLE_ALWAYS_INLINE inline __attribute__((always_inline))

// exp(x) for x in [-104, 89], finite: the core of ExpFn.
// exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2]; exp(r) by a degree-7 polynomial.
template <class F>
static NEEDLE_ALWAYS_INLINE void exp_in_range(F& x) {
  typedef typename IntVec<F>::type I;
  const F magic = F{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds |v| < 2^22 to an integer
  const F t = x * 1.44269504088896341f + magic;
  const F n = t - magic;                 // round(x / ln 2) as a float ...
  const I ni = (I)t - (I)magic;          // ... and as an int (the low mantissa bits of t)
  F r = x - n * 0.693359375f;            // ln 2 = 0.693359375 - 2.12194440e-4, the first part exact in
  r = r - n * -2.12194440e-4f;           // n * 0.693359375 (Cody-Waite)
  const F z = r * r;
  F y = F{} + 1.9875691500E-4f;
  y = y * r + 1.3981999507E-3f;
  y = y * r + 8.3334519073E-3f;
  y = y * r + 4.1665795894E-2f;
  y = y * r + 1.6666665459E-1f;
  y = y * r + 5.0000001201E-1f;
  y = y * z + r + 1.0f;
  // Times 2^n, built in the exponent field.  In two halves, so that n down to -150 (denormal results) and up
  // to 128 need no exponent outside [-126, 127]; only the last multiplication rounds.
  const I n1 = ni >> 1, n2 = ni - n1;
  x = y * (F)((n1 + 127) << 23) * (F)((n2 + 127) << 23);
}

struct ExpFn {
  template <class F>
  static NEEDLE_ALWAYS_INLINE void apply(F& x) {
    F xc = x < -104.0f ? F{} - 104.0f : x;  // exp(-104) rounds to 0, exp(89) to inf: outside, clamp
    xc = xc > 89.0f ? F{} + 89.0f : xc;
    exp_in_range(xc);
    xc = x > 88.72283935546875f ? F{} + __builtin_inff() : xc;
    x = x != x ? x : xc;  // NaN stays NaN
  }
};

struct LogFn {
  // log(x) = e ln 2 + log(1 + f), x = 2^e (1 + f) with 1 + f in [sqrt(1/2), sqrt(2)); log(1 + f) by a polynomial.
  template <class F>
  static NEEDLE_ALWAYS_INLINE void apply(F& x) {
    typedef typename IntVec<F>::type I;
    const I denormal = x < 1.17549435e-38f;        // scaled by 2^23 first, so the exponent field is exact
    const F xs = denormal ? x * 8388608.0f : x;
    const I bits = (I)xs;
    I e = ((bits >> 23) & 0xff) - (denormal ? I{} + (126 + 23) : I{} + 126);
    const F m = (F)((bits & 0x007fffff) | 0x3f000000);  // the mantissa as a float in [0.5, 1)
    const I low = m < 0.707106781186547524f;
    e = low ? e - 1 : e;
    const F f = low ? m + m - 1.0f : m - 1.0f;
    const F z = f * f;
    F y = F{} + 7.0376836292E-2f;
    y = y * f - 1.1514610310E-1f;
    y = y * f + 1.1676998740E-1f;
    y = y * f - 1.2420140846E-1f;
    y = y * f + 1.4249322787E-1f;
    y = y * f - 1.6668057665E-1f;
    y = y * f + 2.0000714765E-1f;
    y = y * f - 2.4999993993E-1f;
    y = y * f + 3.3333331174E-1f;
    y = y * f * z;
    const F fe = __builtin_convertvector(e, F);
    y = y + fe * -2.12194440e-4f;  // e ln 2 in two parts, as in ExpFn
    y = y - 0.5f * z;
    F result = f + y + fe * 0.693359375f;
    result = x == __builtin_inff() ? x : result;
    result = x == 0.0f ? F{} - __builtin_inff() : result;
    result = x < 0.0f ? F{} + __builtin_nanf("") : result;
    x = x != x ? x : result;
  }
};

struct TanhFn {
  // With z = |x|, two formulas are computed for every lane and one is chosen:
  //   z < 0.7:  an odd polynomial z + z^3 P(z^2) (a minimax fit on [0, 0.7]);
  //   z >= 0.7: 1 - 2 / (exp(2z) + 1).  There the result is above 0.6 and 2 / (exp(2z) + 1) below 0.4, so the
  //             subtraction loses little and the error of exp is damped: a degree-6 polynomial is enough, and
  //             2^n fits one exponent field, as z is clamped to 9.1 (the result rounds to exactly 1 from
  //             z = 9.011 on; the clamp also sends +-inf to +-1).  This is cheaper than calling exp_in_range.
  // The sign is copied from x: tanh(-0) = -0.  NaN fails both comparisons, so it takes the polynomial and stays NaN.
  template <class F>
  static NEEDLE_ALWAYS_INLINE void apply(F& x) {
    typedef typename IntVec<F>::type I;
    typedef uint32_t U __attribute__((vector_size(sizeof(F))));
    const F z = (F)((I)x & 0x7fffffff);  // |x|
    const F s = z * z;
    F p = F{} - 5.13865891844e-3f;
    p = p * s + 2.00919657946e-2f;
    p = p * s - 5.35588599741e-2f;
    p = p * s + 1.33291110396e-1f;
    p = p * s - 3.33331912756e-1f;
    const F small = p * s * z + z;
    const F zc = z < 9.1f ? z : F{} + 9.1f;
    // exp(2 zc) = 2^n exp(2r) with n = round(2 zc / ln 2) and r = zc - n ln2/2 in [-ln2/4, ln2/4], as in
    // exp_in_range, but with 1.5 * 2^23 + 127 as the magic number: the low 9 bits of t then hold n + 127, the
    // biased exponent of 2^n, so t << 23 is 2^n.  ln2/2 = 0.3466796875 - 1.06097220e-4 (Cody-Waite).
    const F magic = F{} + 12583039.0f;
    const F t = zc * 2.88539008177792681f + magic;
    const F n = t - magic;
    F r = zc - n * 0.3466796875f;
    r = r - n * -1.06097220e-4f;
    F e = F{} + 8.843709528e-2f;  // exp(2r) by a minimax polynomial
    e = e * r + 2.677930295e-1f;
    e = e * r + 6.666926742e-1f;
    e = e * r + 1.333321810f;
    e = e * r + 1.999999762f;
    e = e * r + 2.0f;
    e = e * r + 1.0f;
    e = e * (F)((U)t << 23) + 1.0f;  // exp(2 zc) + 1
    const F large = 1.0f - 2.0f / e;
    const F result = z >= 0.7f ? large : small;
    x = (F)((I)result | ((I)x & (int32_t)0x80000000));
  }
};

// out[i] = OP(a[i]) for i < n, W lanes at a time; the last n % W elements go through a zero-padded vector, so
// every element gets exactly the same arithmetic.  a may be out (in place).
template <class F, class OP>
static NEEDLE_ALWAYS_INLINE void map_run(const scalar_t* a, scalar_t* out, int64_t n) {
  constexpr int64_t W = sizeof(F) / sizeof(scalar_t);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    F x;
    __builtin_memcpy(&x, a + i, sizeof(F));
    OP::apply(x);
    __builtin_memcpy(out + i, &x, sizeof(F));
  }
  if (i < n) {
    F x = {};
    __builtin_memcpy(&x, a + i, static_cast<size_t>(n - i) * ELEM_SIZE);
    OP::apply(x);
    __builtin_memcpy(out + i, &x, static_cast<size_t>(n - i) * ELEM_SIZE);
  }
}

// Sum of a[0..n) accumulated in double, as numpy's float32 sum is not, but accurately enough that the order
// matters little: FH (floats) are widened to D (doubles with as many lanes) in four independent accumulators.
template <class FH, class D>
static NEEDLE_ALWAYS_INLINE double sum_run(const scalar_t* a, int64_t n) {
  constexpr int64_t W = sizeof(FH) / sizeof(scalar_t);
  D acc[4] = {};
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      FH x;
      __builtin_memcpy(&x, a + i + u * W, sizeof(FH));
      acc[u] += __builtin_convertvector(x, D);
    }
  }
  for (; i + W <= n; i += W) {
    FH x;
    __builtin_memcpy(&x, a + i, sizeof(FH));
    acc[0] += __builtin_convertvector(x, D);
  }
  const D total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  double s = 0.0;
  for (int64_t l = 0; l < W; ++l) s += total[l];
  for (; i < n; ++i) s += a[i];
  return s;
}

// Maximum of a[0..n), n >= 1; NaN if any element is NaN (as numpy's max).  Four accumulators of W lanes; the
// last partial vector is read overlapping the previous one (taking a maximum twice changes nothing).  NaNs
// are remembered by a select into `nan` rather than by OR-ing comparison results: AVX-512 comparisons give
// mask registers, which selects use directly but turning them into a vector of ints needs AVX512DQ.
template <class F>
static NEEDLE_ALWAYS_INLINE scalar_t max_run(const scalar_t* a, int64_t n) {
  constexpr int64_t W = sizeof(F) / sizeof(scalar_t);
  if (n < W) {
    scalar_t m = a[0];
    bool nan = false;
    for (int64_t i = 0; i < n; ++i) {
      m = a[i] > m ? a[i] : m;
      nan |= a[i] != a[i];
    }
    return nan ? std::numeric_limits<scalar_t>::quiet_NaN() : m;
  }
  F acc[4];
  __builtin_memcpy(&acc[0], a, sizeof(F));
  acc[1] = acc[2] = acc[3] = acc[0];
  F nan = {};  // a lane becomes NaN once a NaN passed through it
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      F x;
      __builtin_memcpy(&x, a + i + u * W, sizeof(F));
      nan = x != x ? x : nan;
      acc[u] = x > acc[u] ? x : acc[u];
    }
  }
  for (; i < n; i += W) {
    F x;
    __builtin_memcpy(&x, a + std::min(i, n - W), sizeof(F));
    nan = x != x ? x : nan;
    acc[0] = x > acc[0] ? x : acc[0];
  }
  acc[0] = acc[1] > acc[0] ? acc[1] : acc[0];
  acc[2] = acc[3] > acc[2] ? acc[3] : acc[2];
  acc[0] = acc[2] > acc[0] ? acc[2] : acc[0];
  scalar_t m = acc[0][0];
  bool any_nan = false;
  for (int64_t l = 0; l < W; ++l) {
    m = acc[0][l] > m ? acc[0][l] : m;
    any_nan |= nan[l] != nan[l];
  }
  return any_nan ? std::numeric_limits<scalar_t>::quiet_NaN() : m;
}

// Σ exp(a[i] - m) for i < n (m = the row's maximum, so every term is in [0, 1]): the exp of ExpFn on W lanes at a
// time, four float accumulators (at most n / 4W terms each), summed in double at the end.  The last partial
// vector is padded with -inf, whose exp is 0.
template <class F>
static NEEDLE_ALWAYS_INLINE double sum_exp_run(const scalar_t* a, int64_t n, scalar_t m) {
  constexpr int64_t W = sizeof(F) / sizeof(scalar_t);
  F acc[4] = {};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    F x;
    __builtin_memcpy(&x, a + i, sizeof(F));
    x = x - m;
    ExpFn::apply(x);
    acc[(i / W) & 3] += x;
  }
  if (i < n) {
    F x = F{} - __builtin_inff();
    __builtin_memcpy(&x, a + i, static_cast<size_t>(n - i) * ELEM_SIZE);
    x = x - m;
    ExpFn::apply(x);
    acc[0] += x;
  }
  double s = 0.0;
  for (int u = 0; u < 4; ++u)
    for (int64_t l = 0; l < W; ++l) s += acc[u][l];
  return s;
}

// One set of the kernels above per instruction set: the same template bodies instantiated inside functions
// compiled for AVX-512 (16 lanes), AVX2 + FMA (8 lanes) or the baseline (4 lanes, SSE2 on x86-64) with
// per-function `target` attributes, as the matmul micro-kernels are (matmul_kernels.h).  The widest set the CPU
// supports is chosen at import.  With FMA the polynomials round slightly differently, so the sets may differ in
// the last bit; each is deterministic.
struct VectorKernels {
  const char* name;
  void (*exp)(const scalar_t*, scalar_t*, int64_t);
  void (*log)(const scalar_t*, scalar_t*, int64_t);
  void (*tanh)(const scalar_t*, scalar_t*, int64_t);
  double (*sum)(const scalar_t*, int64_t);
  scalar_t (*max)(const scalar_t*, int64_t);
  double (*sum_exp)(const scalar_t*, int64_t, scalar_t);
};

#define NEEDLE_VECTOR_KERNELS(ISA, TARGET, F, FH, D)                                                         \
  TARGET static void exp_##ISA(const scalar_t* a, scalar_t* o, int64_t n) { map_run<F, ExpFn>(a, o, n); }   \
  TARGET static void log_##ISA(const scalar_t* a, scalar_t* o, int64_t n) { map_run<F, LogFn>(a, o, n); }   \
  TARGET static void tanh_##ISA(const scalar_t* a, scalar_t* o, int64_t n) { map_run<F, TanhFn>(a, o, n); } \
  TARGET static double sum_##ISA(const scalar_t* a, int64_t n) { return sum_run<FH, D>(a, n); }             \
  TARGET static scalar_t max_##ISA(const scalar_t* a, int64_t n) { return max_run<F>(a, n); }               \
  TARGET static double sum_exp_##ISA(const scalar_t* a, int64_t n, scalar_t m) {                            \
    return sum_exp_run<F>(a, n, m);                                                                         \
  }                                                                                                         \
  static const VectorKernels VECTOR_##ISA = {#ISA,      exp_##ISA, log_##ISA, tanh_##ISA,                   \
                                             sum_##ISA, max_##ISA, sum_exp_##ISA};

NEEDLE_VECTOR_KERNELS(generic, , v4sf, v4sf, v4df)
#ifdef NEEDLE_X86_DISPATCH
NEEDLE_VECTOR_KERNELS(avx2, __attribute__((target("avx2,fma"))), v8sf, v4sf, v4df)
NEEDLE_VECTOR_KERNELS(avx512, __attribute__((target("avx512f,avx512vl,avx2,fma"))), v16sf, v8sf, v8df)
#endif

static const VectorKernels* vector_kernels_by_name(const std::string& name) {
  if (!cpu_has(name.c_str())) return nullptr;
#ifdef NEEDLE_X86_DISPATCH
  if (name == "avx512") return &VECTOR_avx512;
  if (name == "avx2") return &VECTOR_avx2;
#endif
  return &VECTOR_generic;
}

static const VectorKernels* g_vector = &VECTOR_generic;  // the widest supported set, chosen at import

static void choose_vector_kernels() {
  for (const char* name : {"avx512", "avx2", "generic"}) {
    const VectorKernels* k = vector_kernels_by_name(name);
    if (k != nullptr) {
      g_vector = k;
      return;
    }
  }
}

static void set_vector_isa(const std::string& name) {
  const VectorKernels* k = vector_kernels_by_name(name);
  if (k == nullptr) fail("set_vector_isa: '" + name + "' is unknown or not supported by this CPU");
  g_vector = k;
}

}  // namespace cpu
}  // namespace needle
