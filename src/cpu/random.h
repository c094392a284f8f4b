// random.h -- counter-based randomness: the random bits of element i are a hash (lowbias32) of (seed, i),
// never a generator's state, so results do not depend on threads, a mask is regenerated from its seed instead
// of kept, and every backend gives the same bits (src/README.md).  dropout and round_stochastic here;
// attention's dropout (attention.h) uses the same hash.
#pragma once

#include "array.h"
#include "common.h"
#include "dtypes.h"
#include "threads.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

namespace needle {
namespace cpu {

// The hash: an integer finalizer with low bias (each input bit flips each output bit with probability ~1/2).
static inline uint32_t lowbias32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7feb352du;
  h ^= h >> 15;
  h *= 0x846ca68bu;
  h ^= h >> 16;
  return h;
}

// dropout: out[i] = a[i] * m / (1 - p), m = 1 where the hash of (seed, i) is >= p * 2^32, else 0: attention's
// counter-based mask (src/README.md) on a flat index, so a mask is regenerated from its seed instead of kept.
static void dropout(const Array& a, Array& out, double p, uint32_t seed) {
  check_size("dropout", "out", out.size, a.size);
  if (!(p >= 0.0 && p < 1.0)) throw py::value_error("dropout: p must be in [0, 1), got " + std::to_string(p));
  const DType dt = same_float_dtype("dropout", {&a, &out});
  const uint32_t threshold = static_cast<uint32_t>(std::min(p * 4294967296.0, 4294967295.0));
  const uint32_t seed_key = seed * 0x9E3779B9u;
  const float keep = static_cast<float>(1.0 - p);
  visit_float(dt, [&](auto t) {
    using T = decltype(t);
    const T* pa = a.data<T>();
    T* po = out.data<T>();
    py::gil_scoped_release release;
    parallel_range(a.size, threads_for(a.size, true), [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) {
        const uint64_t idx = i;
        const uint32_t key = lowbias32(static_cast<uint32_t>(idx >> 32) ^ seed_key);
        const float m = lowbias32(static_cast<uint32_t>(idx) ^ key) >= threshold ? 1.0f : 0.0f;
        po[i] = from_float<T>(to_float(pa[i]) * m / keep);
      }
    });
  });
}

// float32 -> bfloat16, rounding up with probability equal to the discarded fraction: a 16-bit random number is
// added to the lower half of the float32 bits before truncating (carries propagate into the exponent correctly).
// The random number is a hash of (seed, index), key = seed * 0x9E3779B9; inf and NaN round as plain rounding.
static inline bfloat16_t stochastic_bf16(float x, uint32_t key, uint64_t index) {
  const uint32_t u = bits_from_float(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return from_float<bfloat16_t>(x);
  return {static_cast<uint16_t>((u + (lowbias32(static_cast<uint32_t>(index) ^ key) & 0xffffu)) >> 16)};
}

// round_stochastic: out[i] = stochastic_bf16(a[i]) with index offset + i, so a chunk of a larger array, rounded
// with its offset, gets the bits the whole array would.
static void round_stochastic(const Array& a, Array& out, uint32_t seed, uint64_t offset) {
  if (a.dtype != DType::f32 || out.dtype != DType::bf16)
    throw py::type_error("round_stochastic: needs float32 a and bfloat16 out, got " + a.dtype_name() + " and " +
                         out.dtype_name());
  check_size("round_stochastic", "out", out.size, a.size);
  const float* pa = a.data<float>();
  bfloat16_t* po = out.data<bfloat16_t>();
  const uint32_t key = seed * 0x9E3779B9u;
  parallel_range(a.size, threads_for(a.size, false), [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) po[i] = stochastic_bf16(pa[i], key, offset + i);
  });
}

}  // namespace cpu
}  // namespace needle
