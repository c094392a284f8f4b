// dtypes.h -- the storage dtypes (DType: float32, float16, bfloat16, int8, uint8, int32), the conversions
// between them and float32 arithmetic, and visit_float / visit_any, which call a kernel with a dtype's type.
//
// A buffer stores one dtype; arithmetic is always float32 (src/README.md, "Dtypes").  Kernels are written once
// over the storage type T: they read with to_float(T), compute in float and write with from_float<T>, which for
// T = float are the identity, so the float32 code is what it was.  bfloat16 is the upper half of a float32 (same
// exponent, 7 mantissa bits), so widening is a shift and narrowing rounds the lower half away (nearest, ties to
// even); float16 has its own integer conversions below.
#pragma once

#include "common.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

namespace needle {
namespace cpu {

enum class DType : uint8_t { f32, f16, bf16, i8, u8, i32 };

struct DTypeInfo {
  const char* name;     // needle's name
  const char* numpy;    // the numpy type to_numpy returns (bfloat16: its bits as uint16)
  size_t itemsize;
  bool floating;
};
constexpr DTypeInfo DTYPE_INFO[] = {{"float32", "float32", 4, true}, {"float16", "float16", 2, true},
                                    {"bfloat16", "uint16", 2, true}, {"int8", "int8", 1, false},
                                    {"uint8", "uint8", 1, false},    {"int32", "int32", 4, false}};
static const DTypeInfo& info(DType d) { return DTYPE_INFO[static_cast<int>(d)]; }

static DType parse_dtype(const std::string& name) {
  for (int d = 0; d < 6; ++d)
    if (name == DTYPE_INFO[d].name) return static_cast<DType>(d);
  throw py::value_error("Array: unknown dtype '" + name +
                        "' (expected float32, float16, bfloat16, int8, uint8 or int32)");
}

struct bfloat16_t {
  uint16_t bits;
};
struct half_t {
  uint16_t bits;
};

static inline float float_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint32_t bits_from_float(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

static inline float to_float(float x) { return x; }
static inline float to_float(bfloat16_t x) { return float_from_bits(uint32_t(x.bits) << 16); }
// float16 <-> float32 in integer arithmetic (F. Giesen's branch-light conversions), bit for bit what the compiler's
// _Float16 casts give (checked over all 2^16 and 2^32 inputs) but without their library calls, so loops vectorize.
// Widening: move the exponent and mantissa into float32 position and rebias the exponent by 127 - 15; inf/NaN
// (exponent 31) get the rest of the way to 255 (a NaN comes back quiet), and a subnormal half, whose value is
// mantissa * 2^-24, is renormalized by one float subtraction.
static inline float to_float(half_t x) {
  uint32_t u = uint32_t(x.bits & 0x7fffu) << 13;
  const uint32_t exponent = u & 0x0f800000u;
  u += uint32_t(127 - 15) << 23;
  if (exponent == 0x0f800000u) {
    u += uint32_t(128 - 16) << 23;
    if (x.bits & 0x3ffu) u |= 0x00400000u;
  } else if (exponent == 0) {
    u += 1u << 23;
    u = bits_from_float(float_from_bits(u) - float_from_bits(113u << 23));
  }
  return float_from_bits(u | (uint32_t(x.bits & 0x8000u) << 16));
}
template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>
static inline float to_float(I x) {
  return static_cast<float>(x);
}

template <class T>
static inline T from_float(float x);
template <>
inline float from_float<float>(float x) {
  return x;
}
// Adding 0x7fff plus the lowest kept bit, then truncating, rounds to nearest with ties to even; a carry out of
// the mantissa bumps the exponent, which is exactly right (up to +inf).  NaN is kept quiet, never rounded to inf.
template <>
inline bfloat16_t from_float<bfloat16_t>(float x) {
  const uint32_t u = bits_from_float(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x0040u)};
  return {static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
// Narrowing, nearest with ties to even: |x| >= 65536, inf and NaN (kept quiet, with its upper payload bits) first;
// below 2^-14 the result is a subnormal half, and adding 0.5f lets the float adder round x at 2^-24 (the half's
// subnormal step), leaving the half's bits in the low mantissa; otherwise rebias the exponent and round the 13
// dropped mantissa bits by adding 0xfff plus the lowest kept bit (a carry bumps the exponent, up to inf).
template <>
inline half_t from_float<half_t>(float x) {
  const uint32_t u = bits_from_float(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a >= 0x47800000u) return {static_cast<uint16_t>(sign | (a > 0x7f800000u ? 0x7e00u | ((a >> 13) & 0x3ffu)
                                                                               : 0x7c00u))};
  if (a < 0x38800000u)
    return {static_cast<uint16_t>(sign | (bits_from_float(float_from_bits(a) + 0.5f) - 0x3f000000u))};
  a += (uint32_t(15 - 127) << 23) + 0xfffu + ((a >> 13) & 1u);
  return {static_cast<uint16_t>(sign | (a >> 13))};
}
// Float to integer: the fraction is dropped (toward zero), values saturate, NaN is 0.
template <class I>
static inline I saturate_float(float x) {
  constexpr I lo = std::numeric_limits<I>::min(), hi = std::numeric_limits<I>::max();
  if (x != x) return 0;
  if (x <= static_cast<float>(lo)) return lo;
  if (x >= static_cast<float>(hi)) return hi;  // (float(INT32_MAX) rounds up to 2^31, so >= is the test)
  return static_cast<I>(x);
}
template <>
inline int8_t from_float<int8_t>(float x) {
  return saturate_float<int8_t>(x);
}
template <>
inline uint8_t from_float<uint8_t>(float x) {
  return saturate_float<uint8_t>(x);
}
template <>
inline int32_t from_float<int32_t>(float x) {
  return saturate_float<int32_t>(x);
}

// One element of dtype From as dtype To, by the contract's rules (integers to integers saturate exactly).
template <class To, class From>
static inline To convert(From x) {
  if constexpr (std::is_same<To, From>::value) {
    return x;
  } else if constexpr (std::is_integral<To>::value && std::is_integral<From>::value) {
    const int64_t v = static_cast<int64_t>(x);
    return static_cast<To>(std::min<int64_t>(std::max<int64_t>(v, std::numeric_limits<To>::min()),
                                             std::numeric_limits<To>::max()));
  } else {
    return from_float<To>(to_float(x));
  }
}

// Calls f(T()) with the storage type of dtype d: visit_float for the floating dtypes, visit_any for all.
template <class F>
static void visit_float(DType d, F&& f) {
  switch (d) {
    case DType::f32: return f(float());
    case DType::f16: return f(half_t());
    case DType::bf16: return f(bfloat16_t());
    default: throw py::type_error(std::string("needle cpu: ") + info(d).name + " is not a floating dtype");
  }
}
template <class F>
static void visit_any(DType d, F&& f) {
  switch (d) {
    case DType::i8: return f(int8_t());
    case DType::u8: return f(uint8_t());
    case DType::i32: return f(int32_t());
    default: return visit_float(d, f);
  }
}

}  // namespace cpu
}  // namespace needle
