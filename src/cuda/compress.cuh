// compress.cuh -- compressed saved activations: k-bit linear codes with stochastic rounding (quantize_stochastic)
// and back (dequantize_linear), the same bytes as src/cpu/compress.h and the NumPy reference
// (ndarray_backend_numpy.py: stochastic_codes), whose header states the rule once.
//
// Two launches for quantize_stochastic: one thread per block finds its scale, then one thread per group of 8
// codes (fewbit.cuh's packing: no two threads write one byte) rounds and packs them. dequantize_linear is one
// launch, a thread per group.
#pragma once

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "array.cuh"
#include "common.cuh"
#include "dtypes.cuh"
#include "fewbit.cuh"  // code_bytes
#include "random.cuh"  // lowbias32

namespace needle {
namespace cuda {

__global__ void block_scale_kernel(const float* a, float* scales, int64_t n, int64_t block_size, int64_t blocks,
                                   float half) {
  for (int64_t b = first_index(); b < blocks; b += grid_stride()) {
    float m = 0.0f;
    for (int64_t i = b * block_size; i < n && i < (b + 1) * block_size; ++i) {
      const float x = fabsf(a[i]);
      m = (x > m || isnan(x)) ? x : m;  // a NaN stays, as NumPy's max
      if (isnan(m)) break;
    }
    scales[b] = __fdiv_rn(m, half);
  }
}

__global__ void quantize_stochastic_kernel(const float* a, const float* scales, uint8_t* out, int64_t n,
                                           int64_t nbytes, int64_t block_size, int bits, float half,
                                           uint32_t seed_key) {
  const int64_t groups = (n + 7) / 8;
  for (int64_t g = first_index(); g < groups; g += grid_stride()) {
    uint64_t group = 0;
    for (int j = 0; j < 8 && 8 * g + j < n; ++j) {
      const int64_t i = 8 * g + j;
      const float s = scales[i / block_size];
      const uint32_t key = lowbias32(static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32) ^ seed_key);
      const float u = static_cast<float>(lowbias32(static_cast<uint32_t>(i) ^ key) >> 8) * (1.0f / 16777216.0f);
      const float y = __fadd_rn(__fdiv_rn(a[i], s), half);  // rounded as the reference: no contraction
      const float c = floorf(__fadd_rn(y, u));
      const bool ok = isfinite(c) && isfinite(s) && s > 0.0f;
      const float code = ok ? fminf(fmaxf(c, 0.0f), 2.0f * half) : half;
      group |= static_cast<uint64_t>(code) << (j * bits);
    }
    for (int byte = 0; byte < bits && g * bits + byte < nbytes; ++byte) {
      out[g * bits + byte] = static_cast<uint8_t>(group >> (8 * byte));
    }
  }
}

__global__ void dequantize_linear_kernel(const uint8_t* codes, const float* scales, float* out, int64_t n,
                                         int64_t nbytes, int64_t block_size, int bits, float half) {
  const int64_t groups = (n + 7) / 8;
  const uint64_t mask = (uint64_t(1) << bits) - 1;
  for (int64_t g = first_index(); g < groups; g += grid_stride()) {
    uint64_t group = 0;
    for (int byte = 0; byte < bits && g * bits + byte < nbytes; ++byte) {
      group |= uint64_t(codes[g * bits + byte]) << (8 * byte);
    }
    for (int j = 0; j < 8 && 8 * g + j < n; ++j) {
      const int64_t i = 8 * g + j;
      out[i] = __fmul_rn(static_cast<float>((group >> (j * bits)) & mask) - half, scales[i / block_size]);
    }
  }
}

// ---- Host wrappers ----------------------------------------------------------------------------------------

int64_t compress_blocks(const char* fn, size_t n, int64_t block_size, int bits) {
  if (bits < 2 || bits > 8) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": bits must be in 2..8, got " + std::to_string(bits));
  }
  if (block_size < 1) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": block_size must be at least 1, got " +
                          std::to_string(block_size));
  }
  return (as_int64(n) + block_size - 1) / block_size;
}

void quantize_stochastic(const CudaArray& a, CudaArray& out, CudaArray& scales, int bits, int64_t block_size,
                         uint32_t seed) {
  const char* fn = "quantize_stochastic";
  const int64_t blocks = compress_blocks(fn, a.size, block_size, bits), nbytes = code_bytes(fn, a.size, bits);
  check_exact_dtypes(fn, {{"a", a, DType::kFloat32}, {"out", out, DType::kUInt8}, {"scales", scales, DType::kFloat32}});
  check_size(fn, "out", out.size, static_cast<size_t>(nbytes));
  check_size(fn, "scales", scales.size, static_cast<size_t>(blocks));
  const int64_t n = as_int64(a.size);
  if (n == 0) return;
  const float half = static_cast<float>((1 << (bits - 1)) - 1);
  block_scale_kernel<<<grid_for(blocks), kBlockSize>>>(data<float>(a), data<float>(scales), n, block_size, blocks,
                                                      half);
  check_kernel(fn);
  quantize_stochastic_kernel<<<grid_for((n + 7) / 8), kBlockSize>>>(data<float>(a), data<float>(scales),
                                                                    data<uint8_t>(out), n, nbytes, block_size, bits,
                                                                    half, seed * 0x9E3779B9u);
  check_kernel(fn);
}

void dequantize_linear(const CudaArray& codes, const CudaArray& scales, CudaArray& out, int bits, int64_t block_size) {
  const char* fn = "dequantize_linear";
  const int64_t blocks = compress_blocks(fn, out.size, block_size, bits), nbytes = code_bytes(fn, out.size, bits);
  check_exact_dtypes(fn, {{"codes", codes, DType::kUInt8}, {"scales", scales, DType::kFloat32},
                          {"out", out, DType::kFloat32}});
  check_size(fn, "codes", codes.size, static_cast<size_t>(nbytes));
  check_size(fn, "scales", scales.size, static_cast<size_t>(blocks));
  const int64_t n = as_int64(out.size);
  if (n == 0) return;
  dequantize_linear_kernel<<<grid_for((n + 7) / 8), kBlockSize>>>(data<uint8_t>(codes), data<float>(scales),
                                                                  data<float>(out), n, nbytes, block_size, bits,
                                                                  static_cast<float>((1 << (bits - 1)) - 1));
  check_kernel(fn);
}

}  // namespace cuda
}  // namespace needle
