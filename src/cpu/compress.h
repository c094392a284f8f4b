// compress.h -- compressed saved activations (ActNN, Chen et al. 2021): k-bit linear codes with stochastic rounding,
// one scale per block: quantize_stochastic and dequantize_linear. The reference is ndarray_backend_numpy.py
// (stochastic_codes); the bytes are the same on every backend.
//
// The rule, once (src/README.md words it too): h = 2^(bits-1) - 1; block b (block_size consecutive elements) has
// scale[b] = absmax / h in float32 (NaN if the block holds a NaN); element i gets code
//   floor(a[i] / scale + h + u_i),  u_i = (lowbias32 hash of (seed, i), as dropout's) >> 8, times 2^-24,
// in 0..2h, so it dequantizes to (code - h) * scale: one of the two grid points around a[i], the upper one with
// probability equal to a[i]'s distance from the lower one. The expectation is a[i] itself: unbiased. A block whose
// scale is 0 or not finite, and an element whose sum is not finite, get code h: zeros come back as zeros, a block
// holding a NaN or an infinity as NaN (0 times its scale). The codes are packed as fewbit.h packs them (a group of
// 8 codes is one little-endian integer of `bits` bytes).
#pragma once

#include "array.h"
#include "common.h"
#include "dtypes.h"
#include "fewbit.h"  // code_bytes
#include "quantize.h"  // check_blockwise
#include "random.h"  // lowbias32
#include "simd.h"  // NEEDLE_X86_DISPATCH
#include "threads.h"
#include "vector_math.h"  // g_vector: the instruction set chosen

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

namespace needle {
namespace cpu {

constexpr float kMaxFloat = std::numeric_limits<float>::max();

static size_t compress_blocks(const char* fn, size_t n, int64_t block_size, int bits) {
  if (bits < 2 || bits > 8) fail(std::string(fn) + ": bits must be in 2..8, got " + std::to_string(bits));
  if (block_size < 1) fail(std::string(fn) + ": block_size must be at least 1, got " + std::to_string(block_size));
  return (n + static_cast<size_t>(block_size) - 1) / static_cast<size_t>(block_size);
}

// The block of consecutive elements i, i + 1, ...: one division for the first, then a compare per element (a 64-bit
// division per element cost more than everything else the loops do).
struct BlockCursor {
  BlockCursor(size_t first, size_t block_size) : size(block_size), block(first / block_size),
                                                 end((first / block_size + 1) * block_size) {}
  size_t of(size_t i) {
    while (i >= end) ++block, end += size;
    return block;
  }
  size_t size, block, end;
};

// u_i in [0, 1): the top 24 bits of element i's hash (dropout's: `key` = lowbias32(uint32(i >> 32) ^ seed_key), the
// same for a whole group of 8), exact in float32.
static inline float counter_uniform(uint64_t i, uint32_t key) {
  return static_cast<float>(lowbias32(static_cast<uint32_t>(i) ^ key) >> 8) * (1.0f / 16777216.0f);
}

// 8-bit codes of pa[first, stop), one block's elements that share a hash key. The loop has no branches, so it
// vectorizes; the hash's 32-bit multiplies, though, need AVX2 (SSE2, the portable target, has none and leaves the
// loop scalar: 5.8 ns an element against about 1 with AVX2), hence two copies picked at run time as simd.h's kernels
// are. The same operations in the same order: the bytes do not depend on the copy (the product u * 2^-24 is exact,
// so contracting the sum into an FMA changes nothing).
static inline __attribute__((always_inline)) void quantize8_body(const float* pa, uint8_t* po, size_t first,
                                                                 size_t stop, float s, bool scale_ok, uint32_t key) {
  const float half = 127.0f;
  for (size_t i = first; i < stop; ++i) {
    const float v = (pa[i] / s + half) + counter_uniform(i, key);
    const float c = std::min(std::max(v, 0.0f), 254.0f);  // (NaN compares false: caught by `finite`)
    const bool finite = std::fabs(v) <= kMaxFloat;
    po[i] = scale_ok && finite ? static_cast<uint8_t>(static_cast<int32_t>(c)) : uint8_t(127);
  }
}

typedef void (*Quantize8Run)(const float*, uint8_t*, size_t, size_t, float, bool, uint32_t);

static void quantize8_generic(const float* pa, uint8_t* po, size_t first, size_t stop, float s, bool scale_ok,
                              uint32_t key) {
  quantize8_body(pa, po, first, stop, s, scale_ok, key);
}

#ifdef NEEDLE_X86_DISPATCH
__attribute__((target("avx2,fma"))) static void quantize8_avx2(const float* pa, uint8_t* po, size_t first,
                                                               size_t stop, float s, bool scale_ok, uint32_t key) {
  quantize8_body(pa, po, first, stop, s, scale_ok, key);
}
#endif

// The copy for the vector kernels' instruction set (vector_isa(): the widest the CPU has, or what a test set).
static Quantize8Run quantize8_run_for_this_cpu() {
#ifdef NEEDLE_X86_DISPATCH
  if (std::strcmp(g_vector->name, "generic") != 0) return quantize8_avx2;
#endif
  return quantize8_generic;
}

static void quantize_stochastic(const Array& a, Array& out, Array& scales, int bits, int64_t block_size,
                                uint32_t seed) {
  const char* fn = "quantize_stochastic";
  const size_t n = a.size, blocks = compress_blocks(fn, n, block_size, bits), bs = static_cast<size_t>(block_size);
  check_blockwise(fn, {{"a", a, DType::f32, n}, {"out", out, DType::u8, code_bytes(n, bits)},
                       {"scales", scales, DType::f32, blocks}});
  const float* pa = a.data<float>();
  float* ps = scales.data<float>();
  uint8_t* po = out.data<uint8_t>();
  const float half = static_cast<float>((1 << (bits - 1)) - 1);
  const uint64_t top = (uint64_t(1) << bits) - 2;  // 2h, the largest code
  const uint32_t seed_key = seed * 0x9E3779B9u;
  py::gil_scoped_release release;
  parallel_range(blocks, threads_for(n, false), [&](size_t begin, size_t end) {  // the scales: one block a task
    for (size_t b = begin; b < end; ++b) {
      // |a| as integers: for floats without a sign, the bits order as the values do and every NaN's are above
      // infinity's, so one integer max (which vectorizes, where a float max that minds NaN does not) gives the
      // absmax or tells that the block holds a NaN: NumPy's max propagates a NaN, and so does the scale.
      const size_t last = std::min(n, (b + 1) * bs);
      uint32_t top_bits = 0;
      for (size_t i = b * bs; i < last; ++i) {
        uint32_t x;
        std::memcpy(&x, pa + i, sizeof x);
        x &= 0x7fffffffu;
        top_bits = x > top_bits ? x : top_bits;
      }
      float m;
      std::memcpy(&m, &top_bits, sizeof m);
      ps[b] = top_bits > 0x7f800000u ? std::numeric_limits<float>::quiet_NaN() : m / half;
    }
  });
  if (bits == 8) {  // a byte per code: a loop per block, branch-free, that the compiler can vectorize
    const Quantize8Run run = quantize8_run_for_this_cpu();
    parallel_range(blocks, threads_for(n, false), [&](size_t begin, size_t end) {
      for (size_t b = begin; b < end; ++b) {
        const float s = ps[b];
        const bool scale_ok = s > 0.0f && s <= kMaxFloat;
        const size_t last = std::min(n, (b + 1) * bs);
        for (size_t first = b * bs; first < last;) {  // one key per run of i with the same upper 32 bits
          const uint64_t high = static_cast<uint64_t>(first) >> 32;
          const size_t stop = static_cast<size_t>(std::min<uint64_t>(last, (high + 1) << 32));
          const uint32_t key = lowbias32(static_cast<uint32_t>(high) ^ seed_key);
          run(pa, po, first, stop, s, scale_ok, key);
          first = stop;
        }
      }
    });
    return;
  }
  const size_t groups = (n + 7) / 8, nbytes = out.size;
  parallel_range(groups, threads_for(n, false), [&](size_t begin, size_t end) {  // the codes: 8 a group
    for (size_t g = begin; g < end; ++g) {
      uint64_t group = 0;
      BlockCursor block(8 * g, bs);
      const uint32_t key = lowbias32(static_cast<uint32_t>(static_cast<uint64_t>(8 * g) >> 32) ^ seed_key);
      for (size_t j = 0; j < 8 && 8 * g + j < n; ++j) {
        const size_t i = 8 * g + j;
        const float s = ps[block.of(i)];
        const float y = pa[i] / s + half;  // two float32 roundings, then a third for + u: as the reference
        const float v = y + counter_uniform(i, key);
        // code = floor(v) clamped to [0, 2h], without a call to floor: on [0, 2h) floor is truncation; a value,
        // scale or sum that is not finite (NaN fails every comparison) gives h
        const bool ok = s > 0.0f && s <= kMaxFloat && std::fabs(v) <= kMaxFloat;
        const uint64_t code = !ok ? top / 2 : v >= static_cast<float>(top) ? top : v <= 0.0f ? 0 : uint64_t(int32_t(v));
        group |= code << (j * bits);
      }
      for (int byte = 0; byte < bits && g * bits + byte < nbytes; ++byte) {
        po[g * bits + byte] = static_cast<uint8_t>(group >> (8 * byte));
      }
    }
  });
}

static void dequantize_linear(const Array& codes, const Array& scales, Array& out, int bits, int64_t block_size) {
  const char* fn = "dequantize_linear";
  const size_t n = out.size, blocks = compress_blocks(fn, n, block_size, bits), bs = static_cast<size_t>(block_size);
  check_blockwise(fn, {{"codes", codes, DType::u8, code_bytes(n, bits)}, {"scales", scales, DType::f32, blocks},
                       {"out", out, DType::f32, n}});
  const uint8_t* pc = codes.data<uint8_t>();
  const float* ps = scales.data<float>();
  float* po = out.data<float>();
  const float half = static_cast<float>((1 << (bits - 1)) - 1);
  const uint64_t mask = (uint64_t(1) << bits) - 1;
  const size_t groups = (n + 7) / 8, nbytes = codes.size;
  py::gil_scoped_release release;
  if (bits == 8) {  // a byte per code: a loop per block the compiler can vectorize
    parallel_range((n + bs - 1) / bs, threads_for(n, false), [&](size_t begin, size_t end) {
      for (size_t b = begin; b < end; ++b) {
        const float s = ps[b];
        for (size_t i = b * bs; i < std::min(n, (b + 1) * bs); ++i) po[i] = (static_cast<float>(pc[i]) - half) * s;
      }
    });
    return;
  }
  parallel_range(groups, threads_for(n, false), [&](size_t begin, size_t end) {
    for (size_t g = begin; g < end; ++g) {
      uint64_t group = 0;
      for (int byte = 0; byte < bits && g * bits + byte < nbytes; ++byte) {
        group |= uint64_t(pc[g * bits + byte]) << (8 * byte);
      }
      BlockCursor block(8 * g, bs);
      for (size_t j = 0; j < 8 && 8 * g + j < n; ++j) {
        const size_t i = 8 * g + j;
        po[i] = (static_cast<float>((group >> (j * bits)) & mask) - half) * ps[block.of(i)];
      }
    }
  });
}

}  // namespace cpu
}  // namespace needle
