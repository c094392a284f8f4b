// dtypes.cuh -- the six storage dtypes of the CUDA backend, the conversions between them and float32, and the
// one switch that turns a run-time dtype into a compile-time type.
//
// An Array stores float32, float16 (__half), bfloat16 (__nv_bfloat16), int8, uint8 or int32 (src/README.md,
// "Dtypes").  Whatever the storage, arithmetic is float32: a kernel loads each operand with to_float, computes
// in float and rounds the result once, with from_float<T>, when it stores it; reductions and matmul accumulate
// in float.  So each kernel is written once, over its storage type T, and its float32 instantiation is exactly
// the float32-only kernel the backend had before dtypes (to_float(float) and from_float<float> do nothing).
//
// Integers are storage (labels, indices, quantized optimizer state): they are copied and converted (compact,
// ewise_setitem, fill, scalar_setitem, take_rows) and read as indices, never computed with.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common.cuh"

namespace needle {
namespace cuda {

enum class DType { kFloat32, kFloat16, kBFloat16, kInt8, kUInt8, kInt32 };

struct DTypeInfo {
  const char* name;   // as Python spells it
  size_t itemsize;    // bytes per element
  bool floating;      // float32, float16, bfloat16: the dtypes the arithmetic functions take
  const char* numpy;  // the numpy dtype of to_numpy / from_numpy (bfloat16: its bit patterns, as uint16)
};

// Indexed by DType.
constexpr DTypeInfo kDTypes[] = {
    {"float32", 4, true, "float32"}, {"float16", 2, true, "float16"}, {"bfloat16", 2, true, "uint16"},
    {"int8", 1, false, "int8"},      {"uint8", 1, false, "uint8"},    {"int32", 4, false, "int32"},
};

const DTypeInfo& dtype_info(DType dtype) { return kDTypes[static_cast<int>(dtype)]; }
const char* dtype_name(DType dtype) { return dtype_info(dtype).name; }

DType parse_dtype(const std::string& name) {
  for (size_t k = 0; k < std::size(kDTypes); ++k) {
    if (name == kDTypes[k].name) return static_cast<DType>(k);
  }
  throw py::value_error("needle cuda: unknown dtype '" + name +
                        "' (expected float32, float16, bfloat16, int8, uint8 or int32)");
}

// ---- Conversions --------------------------------------------------------------------------------------------
//
// __host__ __device__: the kernels convert every element, and the host converts a fill value or reads indices
// with the very same functions.

// The bits of a float32, and back.
__host__ __device__ inline uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
#endif
}

__host__ __device__ inline float float_from_bits(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
#endif
}

// The value as float32.  Exact for every storage type except int32 beyond 2^24, which rounds to nearest (as
// NumPy's int32 -> float32 does).  A float16 NaN keeps its sign and payload, as in NumPy (__half2float returns
// one canonical NaN), so that a NaN converted between dtypes has the same bits on every backend.
__host__ __device__ inline float to_float(float x) { return x; }
__host__ __device__ inline float to_float(__half x) {
  const uint32_t h = __half_as_ushort(x);
  if ((h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0) {  // NaN: all-ones exponent, non-zero payload
    return float_from_bits(((h & 0x8000u) << 16) | 0x7F800000u | ((h & 0x3FFu) << 13));
  }
  return __half2float(x);
}
__host__ __device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__host__ __device__ inline float to_float(int8_t x) { return static_cast<float>(x); }
__host__ __device__ inline float to_float(uint8_t x) { return static_cast<float>(x); }
__host__ __device__ inline float to_float(int32_t x) { return static_cast<float>(x); }

// The range of each integer storage type (std::numeric_limits is host code to nvcc).
template <typename T>
struct IntRange;
template <>
struct IntRange<int8_t> {
  static constexpr int64_t lo = -128, hi = 127;
};
template <>
struct IntRange<uint8_t> {
  static constexpr int64_t lo = 0, hi = 255;
};
template <>
struct IntRange<int32_t> {
  static constexpr int64_t lo = -2147483648LL, hi = 2147483647LL;
};

// float -> integer as the contract says: NaN -> 0, the fraction dropped (toward zero), saturated at the type's
// range.  The range ends are compared as floats: lo (0 or -2^k) is exact; hi (2^k - 1) may round up to 2^k
// (int32), but then x >= 2^k saturates and anything below it truncates to a value that fits.
template <typename T>
__host__ __device__ T float_to_int(float x) {
  if (x != x) return 0;  // NaN
  if (x <= static_cast<float>(IntRange<T>::lo)) return static_cast<T>(IntRange<T>::lo);
  if (x >= static_cast<float>(IntRange<T>::hi)) return static_cast<T>(IntRange<T>::hi);
  return static_cast<T>(x);  // C++'s float -> int conversion truncates toward zero
}

// float32 -> float16 / bfloat16: to nearest, ties to even, overflow to ±inf (__float2half_rn,
// __float2bfloat16_rn).  Only NaN is handled by hand: CUDA returns one canonical NaN (0x7FFF), while NumPy
// keeps the sign and the payload's top bits (float16) or gives the quiet NaN of the same sign (ml_dtypes'
// bfloat16).  Doing as NumPy does gives a converted NaN the same bits on every backend.
__host__ __device__ inline __half float_to_half(float x) {
  if (x != x) {
    const uint32_t bits = float_bits(x);
    const uint32_t sign = (bits >> 16) & 0x8000u;
    unsigned short h = static_cast<unsigned short>(sign | 0x7C00u | ((bits & 0x7FFFFFu) >> 13));
    if ((h & 0x3FFu) == 0) h |= 1u;  // the payload's top 10 bits were all zero: keep it a NaN, not inf
    return __ushort_as_half(h);
  }
  return __float2half_rn(x);
}

__host__ __device__ inline __nv_bfloat16 float_to_bfloat16(float x) {
  if (x != x) return __ushort_as_bfloat16(static_cast<unsigned short>((float_bits(x) >> 31) ? 0xFFC0u : 0x7FC0u));
  return __float2bfloat16_rn(x);
}

// A float32 result stored as T: the one rounding of every computation.
template <typename T>
__host__ __device__ T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, __half>) {
    return float_to_half(x);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return float_to_bfloat16(x);
  } else {
    return float_to_int<T>(x);
  }
}

// One element of storage type In as storage type Out (compact / ewise_setitem across dtypes: astype).
// The same type is copied bit for bit; integer -> integer saturates (through int64, which holds every value of
// both); everything else goes through float32 (exact except int32 past 2^24) and from_float, which rounds once.
template <typename Out, typename In>
__host__ __device__ Out convert(In x) {
  if constexpr (std::is_same_v<Out, In>) {
    return x;
  } else if constexpr (std::is_integral_v<Out> && std::is_integral_v<In>) {
    const int64_t v = x;
    const int64_t clamped = v < IntRange<Out>::lo ? IntRange<Out>::lo : (v > IntRange<Out>::hi ? IntRange<Out>::hi : v);
    return static_cast<Out>(clamped);
  } else {
    return from_float<Out>(to_float(x));
  }
}

// A row or column index stored in any dtype; the host has checked it is an integer in range before any kernel
// reads it.  Integers are used as they are: an int32 index past 2^24 would not survive a trip through float.
template <typename T>
__device__ int64_t to_index(T v) {
  if constexpr (std::is_integral_v<T>) {
    return v;
  } else {
    return static_cast<int64_t>(to_float(v));
  }
}

// ---- From a run-time dtype to a compile-time type -----------------------------------------------------------
//
// visit_dtype(dtype, f) calls f(TypeTag<T>()) with the storage type T of `dtype`.  f is a generic lambda that
// reads T back as `TypeOf<decltype(tag)>` and launches its kernel for T.  These switches are the only places
// where a dtype becomes a type, so each operation's launch is written once.

template <typename T>
struct TypeTag {
  using type = T;
};
template <typename Tag>
using TypeOf = typename Tag::type;

template <typename Visit>
void visit_dtype(DType dtype, Visit&& visit) {
  switch (dtype) {
    case DType::kFloat32: return visit(TypeTag<float>());
    case DType::kFloat16: return visit(TypeTag<__half>());
    case DType::kBFloat16: return visit(TypeTag<__nv_bfloat16>());
    case DType::kInt8: return visit(TypeTag<int8_t>());
    case DType::kUInt8: return visit(TypeTag<uint8_t>());
    case DType::kInt32: return visit(TypeTag<int32_t>());
  }
}

// The floating dtypes only.  The arithmetic functions check their dtypes before they get here, so their kernels
// are never instantiated for an integer type.
template <typename Visit>
void visit_floating(DType dtype, Visit&& visit) {
  switch (dtype) {
    case DType::kFloat32: return visit(TypeTag<float>());
    case DType::kFloat16: return visit(TypeTag<__half>());
    case DType::kBFloat16: return visit(TypeTag<__nv_bfloat16>());
    default: throw std::logic_error("needle cuda: visit_floating: an integer dtype got past the dtype checks");
  }
}

}  // namespace cuda
}  // namespace needle
