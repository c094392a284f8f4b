// layernorm.h -- fused layer normalization for the C++ CPU backend: layernorm_forward, layernorm_backward.
//
// src/README.md states the contract; the NumPy reference backend is the specification.
//
// x is (rows, n), row-major; each row is normalized over its n elements, then scaled and shifted per column:
//   mean = sum(x) / n,  rstd = 1 / sqrt(sum((x - mean)^2) / n + eps),  xhat = (x - mean) rstd,  y = xhat w + b
// and the gradient for dy = g recomputes mean and rstd instead of storing them:
//   dx = (g w - mean(g w) - xhat mean(g w xhat)) rstd,  dw = sum over rows of g xhat,  db = sum over rows of g.
// Arithmetic is float32 whatever the storage.  Rows are spread over the threads (forward, dx); dw and db over
// blocks of columns, each column summed over the rows in order, so results do not depend on the thread count.
#pragma once

#include "array.h"
#include "common.h"
#include "dtypes.h"
#include "threads.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace needle {
namespace cpu {

static void check_layernorm(const char* fn, int64_t rows, int64_t n, double eps) {
  if (rows < 0 || n < 1)
    fail(std::string(fn) + ": needs rows >= 0 and n >= 1, got rows " + std::to_string(rows) + ", n " +
         std::to_string(n));
  if (!(eps >= 0)) fail(std::string(fn) + ": eps must be >= 0, got " + std::to_string(eps));
}

// (mean, rstd) of one row, two passes (the centered sum of squares, not E[x^2] - mean^2, which cancels).
template <class T>
static void layernorm_row_stats(const T* x, int64_t n, float eps, float* mean, float* rstd) {
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) sum += to_float(x[j]);
  const float m = sum / static_cast<float>(n);
  float squares = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float c = to_float(x[j]) - m;
    squares += c * c;
  }
  *mean = m;
  *rstd = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
}

static void layernorm_forward(const Array& x, const Array& w, const Array& b, Array& out, int64_t rows, int64_t n,
                              double eps) {
  const char* fn = "layernorm_forward";
  check_layernorm(fn, rows, n, eps);
  const DType dt = same_float_dtype(fn, {&x, &w, &b, &out});
  check_extents(fn, "x", x.size, rows, n);
  check_size(fn, "w", w.size, size_t(n));
  check_size(fn, "b", b.size, size_t(n));
  check_extents(fn, "out", out.size, rows, n);
  const float e = static_cast<float>(eps);
  const int nthreads = rows * n >= (int64_t(1) << 16) ? num_threads() : 1;
  py::gil_scoped_release release;
  visit_float(dt, [&](auto tag) {
    using T = decltype(tag);
    const T *xp = x.data<T>(), *wp = w.data<T>(), *bp = b.data<T>();
    T* op = out.data<T>();
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t r = 0; r < rows; ++r) {
      float mean, rstd;
      layernorm_row_stats(xp + r * n, n, e, &mean, &rstd);
      for (int64_t j = 0; j < n; ++j)
        op[r * n + j] = from_float<T>((to_float(xp[r * n + j]) - mean) * rstd * to_float(wp[j]) + to_float(bp[j]));
    }
  });
}

static void layernorm_backward(const Array& x, const Array& w, const Array& g, Array& dx, Array& dw, Array& db,
                               int64_t rows, int64_t n, double eps) {
  const char* fn = "layernorm_backward";
  check_layernorm(fn, rows, n, eps);
  const DType dt = same_float_dtype(fn, {&x, &w, &g, &dx, &dw, &db});
  check_extents(fn, "x", x.size, rows, n);
  check_size(fn, "w", w.size, size_t(n));
  check_extents(fn, "g", g.size, rows, n);
  check_extents(fn, "dx", dx.size, rows, n);
  check_size(fn, "dw", dw.size, size_t(n));
  check_size(fn, "db", db.size, size_t(n));
  const float e = static_cast<float>(eps);
  const int nthreads = rows * n >= (int64_t(1) << 16) ? num_threads() : 1;
  constexpr int64_t COLUMNS = 64;  // columns per dw/db work item: a row's slice of them is one cache line or two
  py::gil_scoped_release release;
  visit_float(dt, [&](auto tag) {
    using T = decltype(tag);
    const T *xp = x.data<T>(), *wp = w.data<T>(), *gp = g.data<T>();
    T *dxp = dx.data<T>(), *dwp = dw.data<T>(), *dbp = db.data<T>();
    std::vector<float> mean(rows), rstd(rows);  // per row, outside the Array accounting (8 bytes a row)
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        const T *xr = xp + r * n, *gr = gp + r * n;
        layernorm_row_stats(xr, n, e, &mean[r], &rstd[r]);
        float c1 = 0.0f, c2 = 0.0f;  // sum(g w), sum(g w xhat)
        for (int64_t j = 0; j < n; ++j) {
          const float gw = to_float(gr[j]) * to_float(wp[j]);
          c1 += gw;
          c2 += gw * ((to_float(xr[j]) - mean[r]) * rstd[r]);
        }
        c1 /= static_cast<float>(n);
        c2 /= static_cast<float>(n);
        for (int64_t j = 0; j < n; ++j) {
          const float xhat = (to_float(xr[j]) - mean[r]) * rstd[r];
          dxp[r * n + j] = from_float<T>((to_float(gr[j]) * to_float(wp[j]) - c1 - xhat * c2) * rstd[r]);
        }
      }
#pragma omp for schedule(static)
      for (int64_t j0 = 0; j0 < n; j0 += COLUMNS) {
        const int64_t j1 = std::min(n, j0 + COLUMNS);
        float sw[COLUMNS] = {}, sb[COLUMNS] = {};
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = j0; j < j1; ++j) {
            const float gv = to_float(gp[r * n + j]);
            sw[j - j0] += gv * ((to_float(xp[r * n + j]) - mean[r]) * rstd[r]);
            sb[j - j0] += gv;
          }
        }
        for (int64_t j = j0; j < j1; ++j) {
          dwp[j] = from_float<T>(sw[j - j0]);
          dbp[j] = from_float<T>(sb[j - j0]);
        }
      }
    }
  });
}

}  // namespace cpu
}  // namespace needle
