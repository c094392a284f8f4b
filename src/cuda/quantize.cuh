// quantize.cuh -- block-wise 8-bit quantization (Dettmers et al. 2021): quantize_blockwise,
// dequantize_blockwise, and nearest_code, which the 8-bit Adam step (optimizer.cuh) also quantizes with.
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

// ---- Block-wise 8-bit quantization (Dettmers et al. 2021) -------------------------------------------------
//
// A flat array of n elements is cut into blocks [b * block_size, min(n, (b + 1) * block_size)).  Block b keeps
// one float, its largest magnitude absmax[b], and each element one byte: the index of the `code` value (256
// ascending floats) nearest to a[i] / absmax[b].  One thread block quantizes one block at a time (grid-stride
// over the blocks), in three steps:
//   1. each thread takes the largest |a[i]| of its elements i = begin + tid, begin + tid + blockDim.x, ...;
//   2. block_reduce combines them (NaN-propagating, as MaximumOp), and every thread gets absmax[b];
//   3. each thread maps the same elements again (a second read of the block, now from cache) through the code
//      table, which each thread block copies to shared memory once.

constexpr int kCodeSize = 256;  // one code value per byte value

// The index the contract gives x (src/README.md): lo = the largest j with code[j] <= x, 0 if there is none (so
// NaN gives 0).  code[j] <= x holds for a prefix of the ascending code, and the search sets one bit of lo per
// step (128, 64, ..., 1) while code[lo + step] is still inside that prefix.  Then the nearer of code[lo] and
// code[lo + 1] wins, a tie going to lo.
__device__ uint8_t nearest_code(const float* code, float x) {
  int lo = 0;
#pragma unroll
  for (int step = kCodeSize / 2; step > 0; step /= 2) {
    if (code[lo + step] <= x) lo += step;
  }
  const int hi = lo + 1 < kCodeSize ? lo + 1 : kCodeSize - 1;
  return static_cast<uint8_t>(code[hi] - x < x - code[lo] ? hi : lo);
}

// blockDim.x must be a multiple of 32 and at most kReduceMaxThreads (block_reduce's requirement).
__global__ void quantize_blockwise_kernel(const float* a, const float* code, uint8_t* out, float* absmax, int64_t n,
                                          int64_t block_size, int64_t num_blocks) {
  __shared__ float table[kCodeSize];
  for (int j = threadIdx.x; j < kCodeSize; j += blockDim.x) table[j] = code[j];
  __syncthreads();
  for (int64_t b = blockIdx.x; b < num_blocks; b += gridDim.x) {  // the same b for every thread of the block
    const int64_t begin = b * block_size;
    const int64_t end = n - begin < block_size ? n : begin + block_size;
    float m = 0.0f;  // every |a[i]| is >= 0 (or NaN, which MaximumOp keeps)
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) m = MaximumOp()(m, fabsf(a[i]));
    m = block_reduce(m, MaxReduce());
    if (threadIdx.x == 0) absmax[b] = m;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const float x = m == 0.0f ? 0.0f : __fdiv_rn(a[i], m);  // IEEE division whatever the compiler flags
      out[i] = nearest_code(table, x);
    }
  }
}

// out[i] = code[q[i]] * absmax[i / block_size], a grid-stride loop with the code table in shared memory.
__global__ void dequantize_blockwise_kernel(const uint8_t* q, const float* code, const float* absmax, float* out,
                                            int64_t n, int64_t block_size) {
  __shared__ float table[kCodeSize];
  for (int j = threadIdx.x; j < kCodeSize; j += blockDim.x) table[j] = code[j];
  __syncthreads();
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = table[q[i]] * absmax[i / block_size];
}

// ---- Host wrappers ----------------------------------------------------------------------------------------

// ceil(n / block_size), the number of quantization blocks (written so that no block_size can overflow it).
int64_t num_quantization_blocks(const char* fn, size_t n, int64_t block_size) {
  if (block_size < 1) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": block_size must be at least 1, got " +
                          std::to_string(block_size));
  }
  return as_int64(n) / block_size + (as_int64(n) % block_size != 0 ? 1 : 0);
}

void quantize_blockwise(const CudaArray& a, const CudaArray& code, CudaArray& out, CudaArray& absmax,
                        int64_t block_size) {
  const char* fn = "quantize_blockwise";
  const int64_t blocks = num_quantization_blocks(fn, a.size, block_size);
  check_exact_dtypes(fn, {{"a", a, DType::kFloat32},
                          {"code", code, DType::kFloat32},
                          {"out", out, DType::kUInt8},
                          {"absmax", absmax, DType::kFloat32}});
  check_size(fn, "code", code.size, kCodeSize);
  check_size(fn, "out", out.size, a.size);
  check_size(fn, "absmax", absmax.size, static_cast<size_t>(blocks));
  if (blocks == 0) return;
  const unsigned grid = static_cast<unsigned>(std::min(blocks, kReduceMaxBlocks));
  quantize_blockwise_kernel<<<grid, reduce_threads(static_cast<size_t>(block_size))>>>(
      data<float>(a), data<float>(code), data<uint8_t>(out), data<float>(absmax), as_int64(a.size), block_size,
      blocks);
  check_kernel(fn);
}

void dequantize_blockwise(const CudaArray& q, const CudaArray& code, const CudaArray& absmax, CudaArray& out,
                          int64_t block_size) {
  const char* fn = "dequantize_blockwise";
  const int64_t blocks = num_quantization_blocks(fn, q.size, block_size);
  check_exact_dtypes(fn, {{"q", q, DType::kUInt8},
                          {"code", code, DType::kFloat32},
                          {"absmax", absmax, DType::kFloat32},
                          {"out", out, DType::kFloat32}});
  check_size(fn, "code", code.size, kCodeSize);
  check_size(fn, "absmax", absmax.size, static_cast<size_t>(blocks));
  check_size(fn, "out", out.size, q.size);
  const int64_t n = as_int64(q.size);
  if (n == 0) return;
  dequantize_blockwise_kernel<<<grid_for(n), kBlockSize>>>(data<uint8_t>(q), data<float>(code), data<float>(absmax),
                                                           data<float>(out), n, block_size);
  check_kernel(fn);
}

}  // namespace cuda
}  // namespace needle
