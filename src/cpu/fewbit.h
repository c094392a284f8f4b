// fewbit.h -- k-bit codes of an activation's input for few-bit backward (Novikov et al. 2023): pack_codes and
// unpack_scale. The reference is ndarray_backend_numpy.py (pack_code_values / unpack_code_values); the bytes are the
// same on every backend.
//
// The layout, once: n codes of `bits` bits (1..8) in ceil(n·bits / 8) bytes, code i at bits [i·bits, (i+1)·bits)
// of a least-significant-bit-first stream. Every 8 codes fill exactly `bits` bytes, so group g (elements 8g .. 8g+7)
// is one little-endian integer of `bits` bytes starting at byte g·bits, code j of the group at its bit j·bits; the
// groups are independent (each is one task here, one thread on CUDA), and a 64-bit accumulator holds any group.
//   pack_codes(a, boundaries, out, bits):      code_i = how many boundaries are <= a[i] (float32; NaN gives 0)
//   unpack_scale(codes, levels, g, out, bits): out[i] = g[i] · levels[code_i] (float32, rounded once)
#pragma once

#include "array.h"
#include "common.h"
#include "dtypes.h"
#include "quantize.h"  // check_blockwise
#include "threads.h"

#include <cstddef>
#include <cstdint>
#include <string>

namespace needle {
namespace cpu {

static size_t code_bytes(size_t n, int bits) { return (n * static_cast<size_t>(bits) + 7) / 8; }

// bits in 1..8 (ValueError), then the table (boundaries or levels: float32) and the packed codes (uint8) of n
// elements, each of its dtype (TypeError) and size (ValueError).
static void check_code_args(const char* fn, int bits, const char* table_name, const Array& table, const Array& codes,
                            size_t n) {
  if (bits < 1 || bits > 8) fail(std::string(fn) + ": bits must be in 1..8, got " + std::to_string(bits));
  const size_t levels = size_t(1) << bits;
  const bool boundaries = std::string(table_name) == "boundaries";
  check_blockwise(fn, {{table_name, table, DType::f32, boundaries ? levels - 1 : levels},
                       {boundaries ? "out" : "codes", codes, DType::u8, code_bytes(n, bits)}});
}

static void pack_codes(const Array& a, const Array& boundaries, Array& out, int bits) {
  const char* fn = "pack_codes";
  same_float_dtype(fn, {&a});
  check_code_args(fn, bits, "boundaries", boundaries, out, a.size);
  const float* b = boundaries.data<float>();
  const int nb = (1 << bits) - 1;
  const size_t n = a.size, nbytes = out.size, groups = (n + 7) / 8;
  uint8_t* po = out.data<uint8_t>();
  visit_float(a.dtype, [&](auto t) {
    using T = decltype(t);
    const T* pa = a.data<T>();
    parallel_range(groups, threads_for(n, false), [&](size_t begin, size_t end) {
      for (size_t g = begin; g < end; ++g) {
        uint64_t group = 0;
        for (size_t j = 0; j < 8 && 8 * g + j < n; ++j) {
          const float x = to_float(pa[8 * g + j]);
          uint64_t code = 0;
          for (int k = 0; k < nb; ++k) code += b[k] <= x;  // boundaries ascend; at most 255 compares
          group |= code << (j * bits);
        }
        for (int byte = 0; byte < bits && g * bits + byte < nbytes; ++byte) {  // the last group may be short
          po[g * bits + byte] = static_cast<uint8_t>(group >> (8 * byte));
        }
      }
    });
  });
}

static void unpack_scale(const Array& codes, const Array& levels, const Array& g, Array& out, int bits) {
  const char* fn = "unpack_scale";
  check_code_args(fn, bits, "levels", levels, codes, g.size);
  check_size(fn, "out", out.size, g.size);
  const float* lv = levels.data<float>();
  const uint8_t* pc = codes.data<uint8_t>();
  const size_t n = g.size, nbytes = codes.size, groups = (n + 7) / 8;
  const uint64_t mask = (uint64_t(1) << bits) - 1;
  visit_float(same_float_dtype(fn, {&g, &out}), [&](auto t) {
    using T = decltype(t);
    const T* pg = g.data<T>();
    T* po = out.data<T>();
    parallel_range(groups, threads_for(n, false), [&](size_t begin, size_t end) {
      for (size_t grp = begin; grp < end; ++grp) {
        uint64_t group = 0;
        for (int byte = 0; byte < bits && grp * bits + byte < nbytes; ++byte) {
          group |= uint64_t(pc[grp * bits + byte]) << (8 * byte);
        }
        for (size_t j = 0; j < 8 && 8 * grp + j < n; ++j) {
          const size_t i = 8 * grp + j;
          po[i] = from_float<T>(to_float(pg[i]) * lv[(group >> (j * bits)) & mask]);
        }
      }
    });
  });
}

}  // namespace cpu
}  // namespace needle
