// matmul.h -- the contract's products of Arrays: matmul (with trans_a / trans_b), matmul_batched and
// matmul_tiled (the course's tiled variant), with their checks and the float32 Accumulator of a 16-bit
// product; the arithmetic is matmul_gemm.h's gemm.
#pragma once

#include "array.h"
#include "common.h"
#include "dtypes.h"
#include "matmul_gemm.h"
#include "threads.h"
#include "views.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

namespace needle {
namespace cpu {

static void check_matmul(const char* fn, const Array& a, const Array& b, const Array& out, int64_t m, int64_t n,
                         int64_t p) {
  if (m < 0 || n < 0 || p < 0) fail(std::string(fn) + ": m, n, p must be >= 0");
  check_extents(fn, "a", a.size, m, n);
  check_extents(fn, "b", b.size, n, p);
  check_extents(fn, "out", out.size, m, p);
  if (out.size != 0 && (out.ptr == a.ptr || out.ptr == b.ptr))
    fail(std::string(fn) + ": out must not be one of the inputs");
}

// The dtypes of a matmul: a and b one floating dtype, out the same or float32.  Returns a's.
static DType check_matmul_dtypes(const char* fn, const Array& a, const Array& b, const Array& out) {
  const DType d = a.dtype;
  if (!info(d).floating || b.dtype != d || (out.dtype != d && out.dtype != DType::f32)) {
    throw py::type_error(std::string(fn) + ": needs floating a and b of one dtype and out of that dtype or "
                         "float32, got " + a.dtype_name() + ", " + b.dtype_name() + " and " + out.dtype_name());
  }
  return d;
}

// Where a product accumulates: out itself when it is float32, else a float32 buffer of out's size that is rounded
// into out at the end. Like the packing buffers it lives outside the allocator: a temporary within one call that no
// Python object ever sees, and that only some machines need (a bfloat16 product without VDPBF16PS), so the memory
// statistics, the Budget's ledger and needle.memory's timeline count the same bytes on every machine.
struct Accumulator {
  explicit Accumulator(Array& out) : out(out) {
    if (out.dtype != DType::f32) tmp.resize(out.size);
  }
  scalar_t* data() { return out.dtype == DType::f32 ? out.ptr : tmp.data(); }
  void finish() {
    if (out.dtype == DType::f32) return;
    visit_float(out.dtype, [&](auto t) {
      using T = decltype(t);
      const float* src = tmp.data();
      T* dst = out.data<T>();
      parallel_range(out.size, threads_for(out.size, false), [&](size_t begin, size_t end) {
        for (size_t i = begin; i < end; ++i) dst[i] = from_float<T>(src[i]);
      });
    });
  }
  Array& out;
  std::vector<float> tmp;
};

// Threads pay off past ~0.5 MFLOP.
static int matmul_threads(int64_t m, int64_t n, int64_t p) {
  return 2.0 * double(m) * double(n) * double(p) < 2.0 * 64 * 64 * 64 ? 1 : num_threads();
}

// out = A @ B with A, B compact (m x n) and (n x p) arrays of storage type T.
template <class T>
static void matmul_compact(const T* A, const T* B, Array& out, DType dt, int64_t m, int64_t n, int64_t p) {
  if constexpr (std::is_same<T, bfloat16_t>::value) {
    if (bf16_out_direct(dt, out, n)) {
      py::gil_scoped_release release;
      gemm(A, B, out.data<bfloat16_t>(), m, n, p, matmul_threads(m, n, p));
      return;
    }
  }
  Accumulator acc(out);
  {
    py::gil_scoped_release release;
    gemm(A, B, acc.data(), m, n, p, matmul_threads(m, n, p));
  }
  acc.finish();
}

// The (cols x rows) row-major transpose of a (rows x cols) row-major matrix, outside the allocator (like the
// packing buffers): for the products that do not pack their operands.
template <class T>
static std::vector<T> transposed(const T* src, int64_t rows, int64_t cols) {
  std::vector<T> t(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[static_cast<size_t>(c * rows + r)] = src[r * cols + c];
  return t;
}

// trans_a: a holds A's transpose, (n x m) row-major; trans_b: b holds B's, (p x n).  A float32 product on the
// packed kernel reads them in place while packing; any other transposes them into temporaries outside the
// allocator first.  Either way no buffer the allocator counts is made, and the bits are those of the product of
// compact copies.  accumulate: out += A @ B, the float32 packed kernel adding its sums to out (other products are
// made outside the allocator, then added to out and rounded once), so a sum of products needs no temporary the
// allocator counts.
static void matmul(const Array& a, const Array& b, Array& out, int64_t m, int64_t n, int64_t p, bool trans_a,
                   bool trans_b, bool accumulate) {
  check_matmul("matmul", a, b, out, m, n, p);
  const DType dt = check_matmul_dtypes("matmul", a, b, out);
  if (m == 0 || p == 0 || (n == 0 && accumulate)) return;
  if (n == 0) {
    fill(out, 0.0f);
    return;
  }
  if (dt == DType::f32 && out.dtype == DType::f32 && uses_packed_kernel(m, n, p) &&
      (trans_a || trans_b || accumulate)) {
    const gemm_fn<float> f = !trans_a && !trans_b ? g_kernel->gemm
                             : !trans_b           ? g_kernel->gemm_ta
                             : !trans_a           ? g_kernel->gemm_tb
                                                  : g_kernel->gemm_tab;
    py::gil_scoped_release release;
    f(a.data<float>(), b.data<float>(), out.ptr, m, n, p, matmul_threads(m, n, p), accumulate);
    return;
  }
  visit_float(dt, [&](auto t) {
    using T = decltype(t);
    std::vector<T> at, bt;
    if (trans_a) at = transposed(a.data<T>(), n, m);
    if (trans_b) bt = transposed(b.data<T>(), p, n);
    const T *A = trans_a ? at.data() : a.data<T>(), *B = trans_b ? bt.data() : b.data<T>();
    if (!accumulate) {
      matmul_compact(A, B, out, dt, m, n, p);
      return;
    }
    std::vector<float> product(static_cast<size_t>(m * p));
    py::gil_scoped_release release;
    gemm(A, B, product.data(), m, n, p, matmul_threads(m, n, p));
    visit_float(out.dtype, [&](auto o) {
      using O = decltype(o);
      O* po = out.data<O>();
      for (size_t i = 0; i < product.size(); ++i) po[i] = from_float<O>(to_float(po[i]) + product[i]);
    });
  });
}

// out[i] = a[i] @ b[i] for i < batch, each product with `per_product` threads, `nthreads` products at a time.
// Returns false if a product failed (an exception must not leave an OpenMP region: it is noted instead).
template <class T, class O>
static bool gemm_batch(const T* a, const T* b, O* out, int64_t batch, int64_t m, int64_t n, int64_t p,
                       int nthreads, int per_product) {
  int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
  for (int64_t i = 0; i < batch; ++i) {
    try {
      gemm(a + i * m * n, b + i * n * p, out + i * m * p, m, n, p, per_product);
    } catch (...) {
#pragma omp atomic write
      failed = 1;
    }
  }
  return failed == 0;
}

// out[i] = a[i] @ b[i] for i < batch: a is (batch, m, n), b (batch, n, p), out (batch, m, p), all compact.
// Products of up to ~256^3 multiply-adds, the attention case of many small matrices, are spread over the
// threads one whole product each, which pays no per-product threading cost; bigger ones run one after another,
// each on all threads (as `matmul` runs them).  A product's bits do not depend on its thread count, so a batch
// gives exactly what a loop of matmuls gives.
static void matmul_batched(const Array& a, const Array& b, Array& out, int64_t batch, int64_t m, int64_t n,
                           int64_t p) {
  if (batch < 0) fail("matmul_batched: batch must be >= 0");
  if (m < 0 || n < 0 || p < 0) fail("matmul_batched: m, n, p must be >= 0");
  check_extents("matmul_batched", "a", a.size, batch, m, n);
  check_extents("matmul_batched", "b", b.size, batch, n, p);
  check_extents("matmul_batched", "out", out.size, batch, m, p);
  if (out.size != 0 && (out.ptr == a.ptr || out.ptr == b.ptr))
    fail("matmul_batched: out must not be one of the inputs");
  const DType dt = check_matmul_dtypes("matmul_batched", a, b, out);
  if (out.size == 0) return;
  if (n == 0) {
    fill(out, 0.0f);
    return;
  }
  const bool spread = batch > 1 && 2.0 * double(m) * double(n) * double(p) < 2.0 * 256 * 256 * 256;
  const int per_product = spread ? 1 : matmul_threads(m, n, p);
  const int nthreads = spread ? num_threads() : 1;
  if (bf16_out_direct(dt, out, n)) {
    bool ok = false;
    {
      py::gil_scoped_release release;
      ok = gemm_batch(a.data<bfloat16_t>(), b.data<bfloat16_t>(), out.data<bfloat16_t>(), batch, m, n, p,
                      nthreads, per_product);
    }
    if (!ok) throw std::bad_alloc();
    return;
  }
  Accumulator acc(out);
  bool ok = false;
  {
    py::gil_scoped_release release;
    visit_float(dt, [&](auto t) {
      using T = decltype(t);
      ok = gemm_batch(a.data<T>(), b.data<T>(), acc.data(), batch, m, n, p, nthreads, per_product);
    });
  }
  if (!ok) throw std::bad_alloc();
  acc.finish();
}

constexpr int TILE = 8;  // __tile_size__ of matmul_tiled

// The course's tiled matmul: a is (m/T, n/T, T, T), b is (n/T, p/T, T, T), out is (m/T, p/T, T, T).
static void matmul_tiled(const Array& a, const Array& b, Array& out, int64_t m, int64_t n, int64_t p) {
  check_matmul("matmul_tiled", a, b, out, m, n, p);
  require_float32("matmul_tiled", {&a, &b, &out});
  if (m % TILE || n % TILE || p % TILE) fail("matmul_tiled: m, n, p must be multiples of __tile_size__ (8)");
  const int64_t mt = m / TILE, nt = n / TILE, pt = p / TILE;
  for (int64_t i = 0; i < mt; ++i) {
    for (int64_t j = 0; j < pt; ++j) {
      scalar_t* __restrict o = out.ptr + (i * pt + j) * TILE * TILE;
      std::fill(o, o + TILE * TILE, 0.0f);
      for (int64_t k = 0; k < nt; ++k) {
        const scalar_t* __restrict at = a.ptr + (i * nt + k) * TILE * TILE;
        const scalar_t* __restrict bt = b.ptr + (k * pt + j) * TILE * TILE;
        for (int r = 0; r < TILE; ++r)
          for (int s = 0; s < TILE; ++s)
            for (int c = 0; c < TILE; ++c) o[r * TILE + c] += at[r * TILE + s] * bt[s * TILE + c];
      }
    }
  }
}

}  // namespace cpu
}  // namespace needle
