// random.cuh -- counter-based randomness: stochastic rounding to bfloat16 (round_stochastic) and dropout.
// Each random number is a hash of an element's index and the seed, with no state, so every backend and every
// launch shape gives the same bits, and a dropout mask is regenerated from its seed instead of kept.
// lowbias32 is also the hash of attention's dropout mask (attention.cuh).
//
// Kernels first, then the host wrappers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "array.cuh"
#include "common.cuh"
#include "dtypes.cuh"

namespace needle {
namespace cuda {

// ---- Stochastic rounding to bfloat16 ----------------------------------------------------------------------
//
// bfloat16 keeps the upper 16 bits of a float32.  Adding a uniform 16-bit random number to the lower 16 bits
// before truncating rounds up with probability (lower bits) / 2^16: the expected result is the exact value, so
// tiny updates to bfloat16 weights are not all lost to round-to-nearest.  The random number is a hash of the
// element's index and the seed (no state): the same bits on every backend and every launch shape.

// Chris Wellons' "lowbias32" integer hash (src/README.md spells it out for all backends).
__host__ __device__ inline uint32_t lowbias32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7feb352du;
  h ^= h >> 15;
  h *= 0x846ca68bu;
  h ^= h >> 16;
  return h;
}

// Element i of float32 x rounded stochastically to bfloat16; seed_hash = uint32(seed * 0x9E3779B9).
__host__ __device__ inline __nv_bfloat16 round_stochastic_element(float x, int64_t i, uint32_t seed_hash) {
  const uint32_t bits = float_bits(x);
  if ((bits & 0x7F800000u) == 0x7F800000u) return from_float<__nv_bfloat16>(x);  // NaN and ±inf as compact does
  // A finite float's bits are at most 0xFF7FFFFF, so adding 0xFFFF cannot wrap; the largest values may carry
  // into the exponent and give ±inf, exactly as the contract's formula says.
  const uint32_t noise = lowbias32(static_cast<uint32_t>(i) ^ seed_hash) & 0xFFFFu;
  return __ushort_as_bfloat16(static_cast<unsigned short>((bits + noise) >> 16));
}

__global__ void round_stochastic_kernel(const float* a, __nv_bfloat16* out, int64_t n, uint32_t seed_hash,
                                        uint64_t offset) {
  for (int64_t i = first_index(); i < n; i += grid_stride())
    out[i] = round_stochastic_element(a[i], static_cast<int64_t>(offset + static_cast<uint64_t>(i)), seed_hash);
}

// dropout (src/README.md): out[i] = a[i] * m / keep, m from the hash of (seed, i) as attention's mask has it.
template <typename T>
__global__ void dropout_kernel(const T* a, T* out, int64_t n, uint32_t seed_key, uint32_t threshold, float keep) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const uint64_t idx = static_cast<uint64_t>(i);
    const uint32_t key = lowbias32(static_cast<uint32_t>(idx >> 32) ^ seed_key);
    const float m = lowbias32(static_cast<uint32_t>(idx) ^ key) >= threshold ? 1.0f : 0.0f;
    out[i] = from_float<T>(__fdiv_rn(__fmul_rn(to_float(a[i]), m), keep));
  }
}

// ---- Host wrappers ----------------------------------------------------------------------------------------

// uint32(seed * 0x9E3779B9), with seed = int(seed) as in the reference (any Python integer, or a float, which
// int() truncates).  It depends only on seed modulo 2^32, which PyLong_AsUnsignedLongLongMask gives for any
// integer (negative, or past 64 bits) in two's complement, as Python's `seed & 0xFFFFFFFF` would.
uint32_t seed_hash_of(const py::object& seed) {
  const py::int_ integer(seed);  // PyNumber_Long, i.e. int(seed); raises TypeError / ValueError otherwise
  return static_cast<uint32_t>(PyLong_AsUnsignedLongLongMask(integer.ptr())) * 0x9E3779B9u;
}

// float32 a -> bfloat16 out of the same size, rounded stochastically with the seed; element i hashes offset + i.
void round_stochastic(const CudaArray& a, CudaArray& out, const py::object& seed, uint64_t offset) {
  if (a.dtype != DType::kFloat32 || out.dtype != DType::kBFloat16 || a.size != out.size) {
    throw py::type_error("needle cuda: round_stochastic: expects float32 a and bfloat16 out of one size, got a " +
                         std::string(dtype_name(a.dtype)) + " (" + std::to_string(a.size) + "), out " +
                         dtype_name(out.dtype) + " (" + std::to_string(out.size) + ")");
  }
  const uint32_t seed_hash = seed_hash_of(seed);
  const int64_t n = as_int64(out.size);
  if (n == 0) return;
  round_stochastic_kernel<<<grid_for(n), kBlockSize>>>(data<float>(a), data<__nv_bfloat16>(out), n, seed_hash,
                                                       offset);
  check_kernel("round_stochastic");
}

void dropout(const CudaArray& a, CudaArray& out, double p, uint32_t seed) {
  check_floating("dropout", {{"a", a}, {"out", out}});
  check_size("dropout", "out", out.size, a.size);
  if (!(p >= 0.0 && p < 1.0)) throw py::value_error("dropout: p must be in [0, 1), got " + std::to_string(p));
  const int64_t n = as_int64(out.size);
  if (n == 0) return;
  const uint32_t threshold = static_cast<uint32_t>(std::min(p * 4294967296.0, 4294967295.0));
  visit_floating(out.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    dropout_kernel<<<grid_for(n), kBlockSize>>>(data<T>(a), data<T>(out), n, seed * 0x9E3779B9u, threshold,
                                                static_cast<float>(1.0 - p));
  });
  check_kernel("dropout");
}

}  // namespace cuda
}  // namespace needle
