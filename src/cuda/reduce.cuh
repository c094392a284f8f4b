// reduce.cuh -- row reductions of the floating dtypes: reduce_sum, reduce_max, reduce_logsumexp and the fused
// softmax cross-entropy gradient (softmax_xent_grad), and the block-wide reduction (block_reduce) that
// quantization, the 8-bit Adam step and layer norm also use.
//
// Kernels first, then the host wrappers.  softmax_xent_grad checks its labels as the row gathers check their
// indices (gather_scatter.cuh).
#pragma once

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "array.cuh"
#include "common.cuh"
#include "dtypes.cuh"
#include "elementwise.cuh"
#include "gather_scatter.cuh"

namespace needle {
namespace cuda {

// ---- Reductions -------------------------------------------------------------------------------------------
//
// `a` is viewed as (rows, reduce_size); out[row] = reduction of that row.  One block per row (grid-stride over
// rows when there are more rows than blocks).  Three stages, all in registers or shared memory:
//   1. each thread folds the elements j = threadIdx.x, threadIdx.x + blockDim.x, ... of the row (coalesced);
//   2. each warp combines its 32 partial results with shuffles (no shared memory, no __syncthreads);
//   3. warp 0 combines the per-warp results staged in shared memory.
// The combination order is fixed for a given launch shape, so results are deterministic run to run.
// Partial results are floats whatever the storage type: only the row's result is rounded to T.

constexpr int kReduceMaxThreads = 256;
constexpr int64_t kReduceMaxBlocks = 65536;

struct SumReduce {
  __device__ static float identity() { return 0.0f; }
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct MaxReduce {
  __device__ static float identity() { return -INFINITY; }
  __device__ float operator()(float a, float b) const { return MaximumOp()(a, b); }
};

// After this, lane 0 holds the reduction of the 32 lanes' values.
template <typename Op>
__device__ float warp_reduce(float value, Op op) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = op(value, __shfl_down_sync(kFullWarpMask, value, offset));
  }
  return value;
}

// blockDim.x must be a multiple of 32 and at most kReduceMaxThreads (the host wrapper guarantees both).
template <typename T, typename Op>
__global__ void reduce_kernel(const T* a, T* out, int64_t rows, int64_t reduce_size, Op op) {
  __shared__ float warp_results[kReduceMaxThreads / kWarpSize];
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int num_warps = static_cast<int>(blockDim.x) / kWarpSize;

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* in = a + row * reduce_size;
    float acc = Op::identity();
    for (int64_t j = threadIdx.x; j < reduce_size; j += blockDim.x) acc = op(acc, to_float(in[j]));  // stage 1
    acc = warp_reduce(acc, op);                                                                       // stage 2
    if (lane == 0) warp_results[warp] = acc;
    __syncthreads();
    if (warp == 0) {                                                                                  // stage 3
      acc = lane < num_warps ? warp_results[lane] : Op::identity();
      acc = warp_reduce(acc, op);
      if (lane == 0) out[row] = from_float<T>(acc);
    }
    __syncthreads();  // warp_results is overwritten for the next row
  }
}

// The same three stages for a whole block, the result handed to every thread (through shared memory).
template <typename Op>
__device__ float block_reduce(float acc, Op op) {
  __shared__ float partial[kReduceMaxThreads / kWarpSize];
  __shared__ float result;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int num_warps = static_cast<int>(blockDim.x) / kWarpSize;
  acc = warp_reduce(acc, op);
  if (lane == 0) partial[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < num_warps ? partial[lane] : Op::identity();
    acc = warp_reduce(acc, op);
    if (lane == 0) result = acc;
  }
  __syncthreads();
  const float value = result;
  __syncthreads();  // partial and result are reused by the next call
  return value;
}

// One block per row of `a` (rows, reduce_size): lse = m + log Σ exp(x - m), m the row's maximum (a row whose
// maximum is not finite gives m).  Writes lse[row] if `lse` is given; if `grad` is given, also the softmax
// cross-entropy gradient grad[row, j] = g[row] * (exp(x_j - lse) - [j == idx[row]]), the row read again.
// lse stays a float inside the kernel: the gradient uses the unrounded value.
template <typename T, typename TIdx>
__global__ void logsumexp_rows_kernel(const T* a, T* lse, const TIdx* idx, const T* g, T* grad, int64_t rows,
                                      int64_t reduce_size) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* in = a + row * reduce_size;
    float m = MaxReduce::identity();
    for (int64_t j = threadIdx.x; j < reduce_size; j += blockDim.x) m = MaxReduce()(m, to_float(in[j]));
    m = block_reduce(m, MaxReduce());
    float total = 0.0f;
    if (isfinite(m)) {
      for (int64_t j = threadIdx.x; j < reduce_size; j += blockDim.x) total += expf(to_float(in[j]) - m);
    }
    total = block_reduce(total, SumReduce());
    const float row_lse = isfinite(m) ? m + logf(total) : m;
    if (lse != nullptr && threadIdx.x == 0) lse[row] = from_float<T>(row_lse);
    if (grad != nullptr) {
      const int64_t label = to_index(idx[row]);
      const float g_row = to_float(g[row]);
      for (int64_t j = threadIdx.x; j < reduce_size; j += blockDim.x) {
        grad[row * reduce_size + j] =
            from_float<T>(g_row * (expf(to_float(in[j]) - row_lse) - (j == label ? 1.0f : 0.0f)));
      }
    }
  }
}

// ---- Host wrappers (floating dtypes) ----------------------------------------------------------------------

// Threads for one row of reduce_size elements: enough whole warps to cover the row once, at most
// kReduceMaxThreads, so short rows do not idle 256 threads.
unsigned reduce_threads(size_t reduce_size) {
  const int64_t row_threads = ceil_div(std::max<int64_t>(as_int64(reduce_size), 1), kWarpSize) * kWarpSize;
  return static_cast<unsigned>(std::min<int64_t>(row_threads, kReduceMaxThreads));
}

template <typename Op>
void reduce_op(const char* name, const CudaArray& a, CudaArray& out, size_t reduce_size, Op op) {
  check_floating(name, {{"a", a}, {"out", out}});
  check_extents(name, "a", a.size, out.size, reduce_size);
  const int64_t rows = as_int64(out.size);
  if (rows == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min(rows, kReduceMaxBlocks));
  visit_floating(out.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    reduce_kernel<<<blocks, reduce_threads(reduce_size)>>>(data<T>(a), data<T>(out), rows, as_int64(reduce_size),
                                                           op);
  });
  check_kernel(name);
}

void reduce_sum(const CudaArray& a, CudaArray& out, size_t reduce_size) {
  reduce_op("reduce_sum", a, out, reduce_size, SumReduce());  // an empty row sums to 0
}

void reduce_max(const CudaArray& a, CudaArray& out, size_t reduce_size) {
  if (reduce_size == 0 && out.size > 0) {  // as numpy: a maximum of nothing is an error, not -inf
    throw py::value_error("needle cuda: reduce_max: cannot take the maximum of an empty row");
  }
  reduce_op("reduce_max", a, out, reduce_size, MaxReduce());
}

// ---- Host wrappers: logsumexp and the softmax cross-entropy gradient --------------------------------------

// Threads per row as reduce_op chooses them, blocks up to kReduceMaxBlocks (grid-stride over more rows).
// Without idx, g and grad (reduce_logsumexp) TIdx is float and idx is nullptr.
template <typename T, typename TIdx>
void logsumexp_rows(const char* name, const T* a, T* lse, const TIdx* idx, const T* g, T* grad, int64_t rows,
                    size_t reduce_size) {
  if (rows == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min(rows, kReduceMaxBlocks));
  logsumexp_rows_kernel<<<blocks, reduce_threads(reduce_size)>>>(a, lse, idx, g, grad, rows, as_int64(reduce_size));
  check_kernel(name);
}

void reduce_logsumexp(const CudaArray& a, CudaArray& out, size_t reduce_size) {
  check_floating("reduce_logsumexp", {{"a", a}, {"out", out}});
  if (reduce_size == 0 && out.size > 0) {
    throw py::value_error("needle cuda: reduce_logsumexp: cannot reduce over zero elements");
  }
  check_extents("reduce_logsumexp", "a", a.size, out.size, reduce_size);
  visit_floating(a.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    logsumexp_rows<T, float>("reduce_logsumexp", data<T>(a), data<T>(out), nullptr, nullptr, nullptr,
                             as_int64(out.size), reduce_size);
  });
}

void softmax_xent_grad(const CudaArray& a, const CudaArray& idx, const CudaArray& g, CudaArray& out,
                       size_t row_size) {
  check_floating("softmax_xent_grad", {{"a", a}, {"g", g}, {"out", out}});
  if (row_size == 0) throw py::value_error("needle cuda: softmax_xent_grad: row_size must be positive");
  check_extents("softmax_xent_grad", "a", a.size, idx.size, row_size);
  check_size("softmax_xent_grad", "g", g.size, idx.size);
  check_extents("softmax_xent_grad", "out", out.size, idx.size, row_size);
  check_row_indices("softmax_xent_grad", idx, as_int64(row_size));
  visit_floating_and_index(a.dtype, idx.dtype, [&](auto data_tag, auto idx_tag) {
    using T = TypeOf<decltype(data_tag)>;
    using TIdx = TypeOf<decltype(idx_tag)>;
    logsumexp_rows<T, TIdx>("softmax_xent_grad", data<T>(a), nullptr, data<TIdx>(idx), data<T>(g), data<T>(out),
                            as_int64(idx.size), row_size);
  });
}

}  // namespace cuda
}  // namespace needle
