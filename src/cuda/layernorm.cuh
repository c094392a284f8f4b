// layernorm.cuh -- fused layer normalization for the CUDA backend.
//
// src/README.md states the contract (layernorm_forward, layernorm_backward); the NumPy reference backend is the
// specification.
//
//   layernorm_forward_kernel   one block per row (grid-stride over rows): mean, then the centered sum of squares
//                              (two block reductions), then each thread writes its elements of the row.
//   layernorm_dx_kernel        one block per row: mean and rstd again, sum(g w) and sum(g w xhat), dx; the row's
//                              mean and rstd go to a scratch buffer for the next kernel.
//   layernorm_dwdb_kernel      one thread per column: dw and db summed over the rows in order (deterministic).
// Arithmetic is float32 whatever the storage; results are rounded once when stored.
#pragma once

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "array.cuh"
#include "common.cuh"
#include "dtypes.cuh"
#include "reduce.cuh"

namespace needle {
namespace cuda {

template <typename T>
__device__ void layernorm_stats(const T* x, int64_t n, float eps, float* mean, float* rstd) {
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) sum += to_float(x[j]);
  const float m = __fdiv_rn(block_reduce(sum, SumReduce()), float(n));
  float squares = 0.0f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const float c = to_float(x[j]) - m;
    squares += c * c;
  }
  *mean = m;
  *rstd = 1.0f / sqrtf(__fdiv_rn(block_reduce(squares, SumReduce()), float(n)) + eps);
}

template <typename T>
__global__ void layernorm_forward_kernel(const T* x, const T* w, const T* b, T* out, int64_t rows, int64_t n,
                                         float eps) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float mean, rstd;
    layernorm_stats(x + r * n, n, eps, &mean, &rstd);
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
      out[r * n + j] = from_float<T>((to_float(x[r * n + j]) - mean) * rstd * to_float(w[j]) + to_float(b[j]));
  }
}

template <typename T>
__global__ void layernorm_dx_kernel(const T* x, const T* w, const T* g, T* dx, float* mean_out, float* rstd_out,
                                    int64_t rows, int64_t n, float eps) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T *xr = x + r * n, *gr = g + r * n;
    float mean, rstd;
    layernorm_stats(xr, n, eps, &mean, &rstd);
    float c1 = 0.0f, c2 = 0.0f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float gw = to_float(gr[j]) * to_float(w[j]);
      c1 += gw;
      c2 += gw * ((to_float(xr[j]) - mean) * rstd);
    }
    c1 = __fdiv_rn(block_reduce(c1, SumReduce()), float(n));
    c2 = __fdiv_rn(block_reduce(c2, SumReduce()), float(n));
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float xhat = (to_float(xr[j]) - mean) * rstd;
      dx[r * n + j] = from_float<T>((to_float(gr[j]) * to_float(w[j]) - c1 - xhat * c2) * rstd);
    }
    if (threadIdx.x == 0) {
      mean_out[r] = mean;
      rstd_out[r] = rstd;
    }
  }
}

template <typename T>
__global__ void layernorm_dwdb_kernel(const T* x, const T* g, const float* mean, const float* rstd, T* dw, T* db,
                                      int64_t rows, int64_t n) {
  for (int64_t j = first_index(); j < n; j += grid_stride()) {
    float sw = 0.0f, sb = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      const float gv = to_float(g[r * n + j]);
      sw += gv * ((to_float(x[r * n + j]) - mean[r]) * rstd[r]);
      sb += gv;
    }
    dw[j] = from_float<T>(sw);
    db[j] = from_float<T>(sb);
  }
}

void check_layernorm(const char* fn, int64_t rows, int64_t n, double eps) {
  if (rows < 0 || n < 1) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": needs rows >= 0 and n >= 1, got rows " +
                          std::to_string(rows) + ", n " + std::to_string(n));
  }
  if (!(eps >= 0)) throw py::value_error(std::string("needle cuda: ") + fn + ": eps must be >= 0");
}

void check_same_dtype(const char* fn, std::initializer_list<const CudaArray*> arrays) {
  for (const CudaArray* a : arrays) {
    if (a->dtype != (*arrays.begin())->dtype)
      throw py::type_error(std::string("needle cuda: ") + fn + ": needs arrays of one dtype");
  }
}

void layernorm_forward(const CudaArray& x, const CudaArray& w, const CudaArray& b, CudaArray& out, int64_t rows,
                       int64_t n, double eps) {
  const char* fn = "layernorm_forward";
  check_layernorm(fn, rows, n, eps);
  check_floating(fn, {{"x", x}, {"w", w}, {"b", b}, {"out", out}});
  check_same_dtype(fn, {&x, &w, &b, &out});
  check_extents(fn, "x", x.size, rows, n);
  check_size(fn, "w", w.size, size_t(n));
  check_size(fn, "b", b.size, size_t(n));
  check_extents(fn, "out", out.size, rows, n);
  if (rows == 0) return;
  const unsigned grid = unsigned(std::min(rows, kReduceMaxBlocks));
  visit_floating(x.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    layernorm_forward_kernel<T><<<grid, reduce_threads(size_t(n))>>>(data<T>(x), data<T>(w), data<T>(b),
                                                                      data<T>(out), rows, n, float(eps));
  });
  check_kernel("layernorm_forward_kernel");
}

void layernorm_backward(const CudaArray& x, const CudaArray& w, const CudaArray& g, CudaArray& dx, CudaArray& dw,
                        CudaArray& db, int64_t rows, int64_t n, double eps) {
  const char* fn = "layernorm_backward";
  check_layernorm(fn, rows, n, eps);
  check_floating(fn, {{"x", x}, {"w", w}, {"g", g}, {"dx", dx}, {"dw", dw}, {"db", db}});
  check_same_dtype(fn, {&x, &w, &g, &dx, &dw, &db});
  check_extents(fn, "x", x.size, rows, n);
  check_size(fn, "w", w.size, size_t(n));
  check_extents(fn, "g", g.size, rows, n);
  check_extents(fn, "dx", dx.size, rows, n);
  check_size(fn, "dw", dw.size, size_t(n));
  check_size(fn, "db", db.size, size_t(n));
  ScratchBuffer stats(2 * std::max<size_t>(size_t(rows), 1) * sizeof(float));  // each row's mean and rstd
  float* mean = static_cast<float*>(stats.get());
  float* rstd = mean + std::max<int64_t>(rows, 1);
  visit_floating(x.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    if (rows > 0) {
      layernorm_dx_kernel<T><<<unsigned(std::min(rows, kReduceMaxBlocks)), reduce_threads(size_t(n))>>>(
          data<T>(x), data<T>(w), data<T>(g), data<T>(dx), mean, rstd, rows, n, float(eps));
      check_kernel("layernorm_dx_kernel");
    }
    layernorm_dwdb_kernel<T><<<grid_for(n), kBlockSize>>>(data<T>(x), data<T>(g), mean, rstd, data<T>(dw),
                                                           data<T>(db), rows, n);
    check_kernel("layernorm_dwdb_kernel");
  });
}

}  // namespace cuda
}  // namespace needle
