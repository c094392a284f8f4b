// adafactor.h -- Adafactor's three passes over one float32 parameter (toolbox/optim/adafactor.py), one call each
// instead of a Python loop over chunks: adafactor_moments (the new row and column means of g^2 + eps1),
// adafactor_sumsq (the chunk sums of u^2, for RMS(u)) and adafactor_step (the update, in place).
//
// The parameter is viewed as `batch` matrices (n, cols); a chunk is up to k = rows_per_chunk whole rows of one
// matrix, as the Python loop takes them (a vector: one matrix (size, 1), k = CHUNK).  Each sum is the one the
// chunk loop made the backend compute: a row's sum as reduce_sum sums it (vector_math.h's sum, in double), a
// chunk's column sums as matmul(ones(1, k), chunk) computes them (matmul_gemm.h's gemm), so the bytes equal the
// chunked composite's.  Element-wise arithmetic is float32, every operation rounded once (no fused multiply-add),
// the hyper-parameters rounded once to float32 as the element-wise ops round Python floats.
#pragma once

#include "adam.h"  // NEEDLE_NO_FMA, check_blockwise
#include "matmul_gemm.h"
#include "vector_math.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace needle {
namespace cpu {

// (batch, n, cols, k) of a parameter of `size` elements, checked: size = batch * n * cols, k >= 1.
struct AdafactorShape {
  AdafactorShape(const char* fn, size_t size, int64_t n_, int64_t cols_, int64_t k_) {
    if (n_ < 1 || cols_ < 1 || k_ < 1) fail(std::string(fn) + ": n, cols and rows_per_chunk must be >= 1");
    n = static_cast<size_t>(n_), cols = static_cast<size_t>(cols_), k = static_cast<size_t>(k_);
    const size_t matrix = checked_product(fn, "a matrix", n, cols);
    if (size % matrix != 0) fail(std::string(fn) + ": theta's size is not a multiple of n * cols");
    batch = size / matrix;
    chunks = (n + k - 1) / k;  // per matrix
  }
  size_t batch, n, cols, k, chunks;
};

// u of element i (matrix b, row `row`): g / sqrt(V) for the factored estimate (r = R / mean(R) to the power -0.5
// per row, c = C^-0.5 per column: u = g * (r * c)) or for the full V (written to *vk: v' = v * beta2 + G *
// (1 - beta2), first step G * (1 - beta2), with G = g * g + eps1; u = g * v'^-0.5 with powf, as scalar_power).
struct AdafactorU {
  const float *g, *r, *c, *v;
  bool factored, first;
  float b2, a2, eps1;
  NEEDLE_NO_FMA float operator()(size_t i, size_t row, size_t col, float* vk) const {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    if (factored) return g[i] * (r[row] * c[col]);
    const float g2 = g[i] * g[i] + eps1;
    *vk = first ? g2 * a2 : v[i] * b2 + g2 * a2;
    return g[i] * std::pow(*vk, -0.5f);
  }
};

// row_out[b * n + i] = the mean of row i of matrix b of G = g * g + eps1 (its sum / cols); col_out[b * cols + j]
// = the mean of column j: each chunk's column sums (gemm of a row of ones), added chunk after chunk in float32,
// divided by n.  A chunk's G lives in this thread's buffer, outside the allocator (like matmul's packing).
NEEDLE_NO_FMA static void adafactor_moments(const Array& grad, Array& row_out, Array& col_out, int64_t n,
                                            int64_t cols, int64_t rows_per_chunk, double eps1) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const char* fn = "adafactor_moments";
  const AdafactorShape s(fn, grad.size, n, cols, rows_per_chunk);
  check_blockwise(fn, {{"grad", grad, DType::f32, grad.size},
                       {"row_out", row_out, DType::f32, s.batch * s.n},
                       {"col_out", col_out, DType::f32, s.batch * s.cols}});
  const float e = static_cast<float>(eps1), fc = static_cast<float>(s.cols), fn_ = static_cast<float>(s.n);
  const float* pg = grad.data<float>();
  float *pr = row_out.data<float>(), *pc = col_out.data<float>();
  py::gil_scoped_release release;
  std::vector<float> g2(std::min(s.k, s.n) * s.cols), ones(std::min(s.k, s.n), 1.0f), part(s.cols);
  for (size_t b = 0; b < s.batch; ++b) {
    float* col = pc + b * s.cols;
    for (size_t r0 = 0; r0 < s.n; r0 += s.k) {
      const size_t rows = std::min(s.k, s.n - r0), first = (b * s.n + r0) * s.cols;
      for (size_t i = 0; i < rows * s.cols; ++i) g2[i] = pg[first + i] * pg[first + i] + e;
      for (size_t i = 0; i < rows; ++i)
        pr[b * s.n + r0 + i] = static_cast<float>(g_vector->sum(g2.data() + i * s.cols, s.cols)) / fc;
      gemm(ones.data(), g2.data(), r0 == 0 ? col : part.data(), 1, rows, s.cols, 1);
      if (r0 != 0)
        for (size_t j = 0; j < s.cols; ++j) col[j] = col[j] + part[j];
    }
    for (size_t j = 0; j < s.cols; ++j) col[j] = col[j] / fn_;
  }
}

static AdafactorU adafactor_u(const Array& grad, const Array& r, const Array& c, const Array& v, bool factored,
                              bool first, double beta2, double eps1) {
  return {grad.data<float>(), r.data<float>(), c.data<float>(), v.data<float>(), factored, first,
          static_cast<float>(beta2), static_cast<float>(1.0 - beta2), static_cast<float>(eps1)};
}

// The sizes of r, c (factored) or v (full) for a parameter of shape s.
static void check_adafactor(const char* fn, const AdafactorShape& s, const Array& theta, const Array& grad,
                            const Array& r, const Array& c, const Array& v, bool factored) {
  const size_t size = grad.size;
  check_blockwise(fn, {{"theta", theta, DType::f32, size},
                       {"grad", grad, DType::f32, size},
                       {"r", r, DType::f32, factored ? s.batch * s.n : r.size},
                       {"c", c, DType::f32, factored ? s.batch * s.cols : c.size},
                       {"v", v, DType::f32, factored ? v.size : size}});
}

// sums[q] = the sum of u * u over chunk q (q = b * chunks + r0 / k), as reduce_sum sums one row; nothing written.
NEEDLE_NO_FMA static void adafactor_sumsq(const Array& grad, const Array& r, const Array& c, const Array& v,
                                          Array& sums, bool factored, bool first, int64_t n, int64_t cols,
                                          int64_t rows_per_chunk, double beta2, double eps1) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const char* fn = "adafactor_sumsq";
  const AdafactorShape s(fn, grad.size, n, cols, rows_per_chunk);
  check_adafactor(fn, s, grad, grad, r, c, v, factored);
  check_blockwise(fn, {{"sums", sums, DType::f32, s.batch * s.chunks}});
  const AdafactorU u = adafactor_u(grad, r, c, v, factored, first, beta2, eps1);
  float* ps = sums.data<float>();
  const int64_t total = static_cast<int64_t>(s.batch * s.chunks);
  const int nthreads = threads_for(grad.size, true);
  py::gil_scoped_release release;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    std::vector<float> uu(std::min(s.k, s.n) * s.cols);  // one chunk's u * u
#pragma omp for schedule(static)
    for (int64_t q = 0; q < total; ++q) {
      const size_t b = static_cast<size_t>(q) / s.chunks, r0 = static_cast<size_t>(q) % s.chunks * s.k;
      const size_t rows = std::min(s.k, s.n - r0), first_i = (b * s.n + r0) * s.cols;
      float vk;
      for (size_t i = 0; i < rows; ++i)
        for (size_t j = 0; j < s.cols; ++j) {
          const float x = u(first_i + i * s.cols + j, b * s.n + r0 + i, b * s.cols + j, &vk);
          uu[i * s.cols + j] = x * x;
        }
      ps[q] = static_cast<float>(g_vector->sum(uu.data(), static_cast<int64_t>(rows * s.cols)));
    }
  }
}

// The update, in place: u as above (the full V written back), then u = u * scale; with momentum m' = m * beta1 +
// u * (1 - beta1) (first step u * (1 - beta1)), written, and u = m'; theta' = theta - theta * (wd * lr) (only
// when weight_decay != 0) - u.
NEEDLE_NO_FMA static void adafactor_step(Array& theta, const Array& grad, const Array& r, const Array& c, Array& v,
                                         Array& m, bool factored, bool first_v, bool first_m, bool momentum,
                                         int64_t n, int64_t cols, double beta2, double eps1, double scale,
                                         double beta1, double lr, double weight_decay) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const char* fn = "adafactor_step";
  const AdafactorShape s(fn, grad.size, n, cols, 1);
  check_adafactor(fn, s, theta, grad, r, c, v, factored);
  check_blockwise(fn, {{"m", m, DType::f32, momentum ? grad.size : m.size}});
  const AdafactorU u = adafactor_u(grad, r, c, v, factored, first_v, beta2, eps1);
  const float sc = static_cast<float>(scale), b1 = static_cast<float>(beta1), a1 = static_cast<float>(1.0 - beta1);
  const float wdlr = static_cast<float>(weight_decay * lr);
  const bool decay = weight_decay != 0.0;
  float *pt = theta.data<float>(), *pv = v.data<float>(), *pm = m.data<float>();
  const int64_t rows = static_cast<int64_t>(s.batch * s.n);
  const int nthreads = threads_for(grad.size, true);
  py::gil_scoped_release release;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t row = 0; row < rows; ++row) {  // a row of a matrix: its columns' c start at cbase
    const size_t first = static_cast<size_t>(row) * s.cols, cbase = static_cast<size_t>(row) / s.n * s.cols;
    for (size_t j = 0; j < s.cols; ++j) {
      const size_t i = first + j;
      float vk = 0.0f;
      float uk = u(i, static_cast<size_t>(row), cbase + j, &vk) * sc;
      if (!factored) pv[i] = vk;
      if (momentum) {
        uk = first_m ? uk * a1 : pm[i] * b1 + uk * a1;
        pm[i] = uk;
      }
      const float t = decay ? pt[i] - pt[i] * wdlr : pt[i];
      pt[i] = t - uk;
    }
  }
}

}  // namespace cpu
}  // namespace needle
