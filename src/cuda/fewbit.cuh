// fewbit.cuh -- k-bit codes of an activation's input for few-bit backward: pack_codes and unpack_scale, the same
// bytes as src/cpu/fewbit.h and the NumPy reference (ndarray_backend_numpy.py: pack_code_values).
//
// The layout (src/cpu/fewbit.h says it once): code i at bits [i·bits, (i+1)·bits) of a least-significant-bit-first
// stream, so each group of 8 codes is one little-endian integer of `bits` bytes at byte g·bits. One thread packs or
// unpacks one group (grid-stride over the groups): no two threads write one byte.
#pragma once

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "array.cuh"
#include "common.cuh"
#include "dtypes.cuh"

namespace needle {
namespace cuda {

template <typename T>
__global__ void pack_codes_kernel(const T* a, const float* boundaries, int num_boundaries, uint8_t* out, int64_t n,
                                  int64_t nbytes, int bits) {
  const int64_t groups = (n + 7) / 8;
  for (int64_t g = first_index(); g < groups; g += grid_stride()) {
    uint64_t group = 0;
    for (int j = 0; j < 8 && 8 * g + j < n; ++j) {
      const float x = to_float(a[8 * g + j]);
      uint64_t code = 0;
      for (int k = 0; k < num_boundaries; ++k) code += boundaries[k] <= x;  // NaN compares false: code 0
      group |= code << (j * bits);
    }
    for (int byte = 0; byte < bits && g * bits + byte < nbytes; ++byte) {
      out[g * bits + byte] = static_cast<uint8_t>(group >> (8 * byte));
    }
  }
}

template <typename T>
__global__ void unpack_scale_kernel(const uint8_t* codes, const float* levels, const T* g, T* out, int64_t n,
                                    int64_t nbytes, int bits) {
  const int64_t groups = (n + 7) / 8;
  const uint64_t mask = (uint64_t(1) << bits) - 1;
  for (int64_t grp = first_index(); grp < groups; grp += grid_stride()) {
    uint64_t group = 0;
    for (int byte = 0; byte < bits && grp * bits + byte < nbytes; ++byte) {
      group |= uint64_t(codes[grp * bits + byte]) << (8 * byte);
    }
    for (int j = 0; j < 8 && 8 * grp + j < n; ++j) {
      const int64_t i = 8 * grp + j;
      out[i] = from_float<T>(to_float(g[i]) * levels[(group >> (j * bits)) & mask]);
    }
  }
}

// ---- Host wrappers ----------------------------------------------------------------------------------------

int64_t code_bytes(const char* fn, size_t n, int bits) {
  if (bits < 1 || bits > 8) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": bits must be in 1..8, got " + std::to_string(bits));
  }
  return (as_int64(n) * bits + 7) / 8;
}

void pack_codes(const CudaArray& a, const CudaArray& boundaries, CudaArray& out, int bits) {
  const char* fn = "pack_codes";
  const int64_t nbytes = code_bytes(fn, a.size, bits);
  check_floating(fn, {{"a", a}});
  check_exact_dtypes(fn, {{"boundaries", boundaries, DType::kFloat32}, {"out", out, DType::kUInt8}});
  check_size(fn, "boundaries", boundaries.size, (size_t(1) << bits) - 1);
  check_size(fn, "out", out.size, static_cast<size_t>(nbytes));
  const int64_t n = as_int64(a.size);
  if (n == 0) return;
  visit_floating(a.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    pack_codes_kernel<<<grid_for((n + 7) / 8), kBlockSize>>>(data<T>(a), data<float>(boundaries), (1 << bits) - 1,
                                                             data<uint8_t>(out), n, nbytes, bits);
  });
  check_kernel(fn);
}

void unpack_scale(const CudaArray& codes, const CudaArray& levels, const CudaArray& g, CudaArray& out, int bits) {
  const char* fn = "unpack_scale";
  const int64_t nbytes = code_bytes(fn, g.size, bits);
  check_floating(fn, {{"g", g}, {"out", out}});
  check_exact_dtypes(fn, {{"codes", codes, DType::kUInt8}, {"levels", levels, DType::kFloat32}});
  check_size(fn, "codes", codes.size, static_cast<size_t>(nbytes));
  check_size(fn, "levels", levels.size, size_t(1) << bits);
  check_size(fn, "out", out.size, g.size);
  if (g.dtype != out.dtype) throw py::type_error(std::string("needle cuda: ") + fn + ": g and out differ in dtype");
  const int64_t n = as_int64(g.size);
  if (n == 0) return;
  visit_floating(g.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    unpack_scale_kernel<<<grid_for((n + 7) / 8), kBlockSize>>>(data<uint8_t>(codes), data<float>(levels), data<T>(g),
                                                               data<T>(out), n, nbytes, bits);
  });
  check_kernel(fn);
}

}  // namespace cuda
}  // namespace needle
