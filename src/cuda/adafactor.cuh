// adafactor.cuh -- Adafactor's three passes over one float32 parameter (src/README.md): adafactor_moments (the
// new row and column means of G = g^2 + eps1), adafactor_sumsq (the chunk sums of u^2, for RMS(u)) and
// adafactor_step (the update, in place).  The parameter is `batch` matrices (n, cols); a chunk is up to k whole
// rows of one matrix, as toolbox/optim/adafactor.py's loop takes them.  Each sum is summed as this backend's own
// kernels sum what that loop hands them: a row as reduce_kernel sums it (blockDim = reduce_threads(its length)),
// a chunk's columns as the tiled matmul of a row of ones sums them (in order, from 0).  Every operation is an IEEE
// round-to-nearest intrinsic (no contraction), so the bytes are the chunk loop's.
//
// Kernels first, then the host wrappers.
#pragma once

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "array.cuh"
#include "common.cuh"
#include "reduce.cuh"

namespace needle {
namespace cuda {

// u of element i in global row `row` and column index `col` of c (see src/README.md, adafactor_sumsq); the full
// V's new value in *vk.
struct AdafactorU {
  const float *g, *r, *c, *v;
  bool factored, first;
  float b2, a2, eps1;
  __device__ float operator()(int64_t i, int64_t row, int64_t col, float* vk) const {
    if (factored) return __fmul_rn(g[i], __fmul_rn(r[row], c[col]));
    const float g2 = __fadd_rn(__fmul_rn(g[i], g[i]), eps1);
    *vk = first ? __fmul_rn(g2, a2) : __fadd_rn(__fmul_rn(v[i], b2), __fmul_rn(g2, a2));
    return __fmul_rn(g[i], powf(*vk, -0.5f));  // scalar_power's powf
  }
};

struct AdafactorShape {
  int64_t batch, n, cols, k, chunks;  // chunks per matrix
};

// One block per row of all matrices (grid-stride), reduce_kernel's three stages over G: the row's mean.
__global__ void adafactor_rows_kernel(const float* g, float* row_out, int64_t rows, int64_t cols, float eps1) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* in = g + row * cols;
    float acc = 0.0f;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
      acc = __fadd_rn(acc, __fadd_rn(__fmul_rn(in[j], in[j]), eps1));
    acc = block_reduce(acc, SumReduce());
    if (threadIdx.x == 0) row_out[row] = __fdiv_rn(acc, static_cast<float>(cols));
  }
}

// One thread per column of each matrix: each chunk's column sum from 0 in row order (the tiled matmul's order),
// the chunk sums added in float32, divided by n.
__global__ void adafactor_cols_kernel(const float* g, float* col_out, AdafactorShape s, float eps1) {
  for (int64_t e = first_index(); e < s.batch * s.cols; e += grid_stride()) {
    const int64_t b = e / s.cols, j = e % s.cols;
    float col = 0.0f;
    for (int64_t r0 = 0; r0 < s.n; r0 += s.k) {
      float part = 0.0f;
      for (int64_t row = r0; row < s.n && row < r0 + s.k; ++row) {
        const float x = g[(b * s.n + row) * s.cols + j];
        part = __fadd_rn(part, __fadd_rn(__fmul_rn(x, x), eps1));
      }
      col = r0 == 0 ? part : __fadd_rn(col, part);
    }
    col_out[e] = __fdiv_rn(col, static_cast<float>(s.n));
  }
}

// One block per chunk (grid-stride): reduce_kernel's stages over the chunk's u * u with the stride it would use
// for that length (reduce_threads(len) <= blockDim; threads past it hold 0, which leaves every partial sum as it
// is: sums of squares are never -0).
__global__ void adafactor_sumsq_kernel(AdafactorU u, float* sums, AdafactorShape s) {
  for (int64_t q = blockIdx.x; q < s.batch * s.chunks; q += gridDim.x) {
    const int64_t b = q / s.chunks, r0 = q % s.chunks * s.k, rows = s.n - r0 < s.k ? s.n - r0 : s.k;
    const int64_t len = rows * s.cols, first = (b * s.n + r0) * s.cols;
    const int64_t warps = (len + kWarpSize - 1) / kWarpSize * kWarpSize;
    const int64_t active = warps < kReduceMaxThreads ? warps : kReduceMaxThreads;  // reduce_threads(len)
    float acc = 0.0f, vk;
    for (int64_t j = threadIdx.x; threadIdx.x < active && j < len; j += active) {
      const int64_t i = first + j, row = i / s.cols;
      const float x = u(i, row, b * s.cols + i % s.cols, &vk);
      acc = __fadd_rn(acc, __fmul_rn(x, x));
    }
    acc = block_reduce(acc, SumReduce());
    if (threadIdx.x == 0) sums[q] = acc;
  }
}

struct AdafactorHyper {
  float scale, b1, a1, wdlr;
  bool momentum, first_m, decay;
};

__global__ void adafactor_step_kernel(float* theta, AdafactorU u, float* v, float* m, AdafactorShape s,
                                      AdafactorHyper h) {
  for (int64_t i = first_index(); i < s.batch * s.n * s.cols; i += grid_stride()) {
    const int64_t row = i / s.cols;
    float vk = 0.0f;
    float uk = __fmul_rn(u(i, row, row / s.n * s.cols + i % s.cols, &vk), h.scale);
    if (!u.factored) v[i] = vk;
    if (h.momentum) {
      uk = h.first_m ? __fmul_rn(uk, h.a1) : __fadd_rn(__fmul_rn(m[i], h.b1), __fmul_rn(uk, h.a1));
      m[i] = uk;
    }
    const float t = h.decay ? __fsub_rn(theta[i], __fmul_rn(theta[i], h.wdlr)) : theta[i];
    theta[i] = __fsub_rn(t, uk);
  }
}

// ---- Host wrappers ----------------------------------------------------------------------------------------

AdafactorShape adafactor_shape(const char* fn, size_t size, int64_t n, int64_t cols, int64_t k) {
  if (n < 1 || cols < 1 || k < 1) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": n, cols and rows_per_chunk must be >= 1");
  }
  const size_t matrix = checked_product(fn, "a matrix", n, cols);
  if (size % matrix != 0) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": grad's size is not a multiple of n * cols");
  }
  return {as_int64(size / matrix), n, cols, k, ceil_div(n, k)};
}

AdafactorU adafactor_u(const char* fn, const AdafactorShape& s, const CudaArray& grad, const CudaArray& r,
                       const CudaArray& c, const CudaArray& v, bool factored, bool first, double beta2,
                       double eps1) {
  check_exact_dtypes(fn, {{"grad", grad, DType::kFloat32}, {"r", r, DType::kFloat32}, {"c", c, DType::kFloat32},
                          {"v", v, DType::kFloat32}});
  if (factored) {
    check_size(fn, "r", r.size, static_cast<size_t>(s.batch * s.n));
    check_size(fn, "c", c.size, static_cast<size_t>(s.batch * s.cols));
  } else {
    check_size(fn, "v", v.size, grad.size);
  }
  return {data<float>(grad), data<float>(r), data<float>(c), data<float>(v), factored, first,
          static_cast<float>(beta2), static_cast<float>(1.0 - beta2), static_cast<float>(eps1)};
}

void adafactor_moments(const CudaArray& grad, CudaArray& row_out, CudaArray& col_out, int64_t n, int64_t cols,
                       int64_t rows_per_chunk, double eps1) {
  const char* fn = "adafactor_moments";
  const AdafactorShape s = adafactor_shape(fn, grad.size, n, cols, rows_per_chunk);
  check_exact_dtypes(fn, {{"grad", grad, DType::kFloat32}, {"row_out", row_out, DType::kFloat32},
                          {"col_out", col_out, DType::kFloat32}});
  check_size(fn, "row_out", row_out.size, static_cast<size_t>(s.batch * s.n));
  check_size(fn, "col_out", col_out.size, static_cast<size_t>(s.batch * s.cols));
  if (grad.size == 0) return;
  const float e = static_cast<float>(eps1);
  const unsigned blocks = static_cast<unsigned>(std::min(s.batch * s.n, kReduceMaxBlocks));
  adafactor_rows_kernel<<<blocks, reduce_threads(static_cast<size_t>(cols))>>>(data<float>(grad),
                                                                             data<float>(row_out), s.batch * s.n,
                                                                             cols, e);
  check_kernel("adafactor_moments (rows)");
  adafactor_cols_kernel<<<grid_for(s.batch * s.cols), kBlockSize>>>(data<float>(grad), data<float>(col_out), s, e);
  check_kernel("adafactor_moments (columns)");
}

void adafactor_sumsq(const CudaArray& grad, const CudaArray& r, const CudaArray& c, const CudaArray& v,
                     CudaArray& sums, bool factored, bool first, int64_t n, int64_t cols, int64_t rows_per_chunk,
                     double beta2, double eps1) {
  const char* fn = "adafactor_sumsq";
  const AdafactorShape s = adafactor_shape(fn, grad.size, n, cols, rows_per_chunk);
  const AdafactorU u = adafactor_u(fn, s, grad, r, c, v, factored, first, beta2, eps1);
  check_exact_dtypes(fn, {{"sums", sums, DType::kFloat32}});
  check_size(fn, "sums", sums.size, static_cast<size_t>(s.batch * s.chunks));
  if (sums.size == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min(s.batch * s.chunks, kReduceMaxBlocks));
  const size_t longest = static_cast<size_t>(std::min(s.k, s.n) * s.cols);
  adafactor_sumsq_kernel<<<blocks, reduce_threads(longest)>>>(u, data<float>(sums), s);
  check_kernel(fn);
}

void adafactor_step(CudaArray& theta, const CudaArray& grad, const CudaArray& r, const CudaArray& c, CudaArray& v,
                    CudaArray& m, bool factored, bool first_v, bool first_m, bool momentum, int64_t n, int64_t cols,
                    double beta2, double eps1, double scale, double beta1, double lr, double weight_decay) {
  const char* fn = "adafactor_step";
  const AdafactorShape s = adafactor_shape(fn, grad.size, n, cols, 1);
  const AdafactorU u = adafactor_u(fn, s, grad, r, c, v, factored, first_v, beta2, eps1);
  check_exact_dtypes(fn, {{"theta", theta, DType::kFloat32}, {"m", m, DType::kFloat32}});
  check_size(fn, "theta", theta.size, grad.size);
  if (momentum) check_size(fn, "m", m.size, grad.size);
  if (grad.size == 0) return;
  const AdafactorHyper h{static_cast<float>(scale), static_cast<float>(beta1), static_cast<float>(1.0 - beta1),
                         static_cast<float>(weight_decay * lr), momentum, first_m, weight_decay != 0.0};
  adafactor_step_kernel<<<grid_for(as_int64(grad.size)), kBlockSize>>>(data<float>(theta), u, data<float>(v),
                                                                       data<float>(m), s, h);
  check_kernel(fn);
}

}  // namespace cuda
}  // namespace needle
