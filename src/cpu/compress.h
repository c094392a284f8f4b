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

// u_i in [0, 1): the top 24 bits of element i's hash (dropout's: `key` = lowbias32(uint32(i >> 32) ^ seed_key), the
// same for a whole group of 8), exact in float32.
static inline float counter_uniform(uint64_t i, uint32_t key) {
  return static_cast<float>(lowbias32(static_cast<uint32_t>(i) ^ key) >> 8) * (1.0f / 16777216.0f);
}

// The codes of pa[first, stop) (elements that share a block's scale and a hash key) into out[0, stop - first), one
// byte each: code = floor(a / scale + h + u) clamped to [0, 2h] (`half` = h, `top` = 2h), h where the value, the
// scale or the sum is not finite (NaN fails every comparison). On [0, 2h) floor is truncation, so the loop has no
// branches and vectorizes; the hash's 32-bit multiplies, though, need AVX2 (SSE2, the portable target, has none
// and leaves the loop scalar: 5.8 ns an element against about 1 with AVX2), hence two copies picked at run time,
// as simd.h's kernels are. The same operations in the same order: the bytes do not depend on the copy (the product
// u * 2^-24 is exact, so contracting the sum into an FMA changes nothing).
static inline __attribute__((always_inline)) void codes_body(const float* pa, uint8_t* out, size_t first, size_t stop,
                                                             float s, bool scale_ok, uint32_t key, float half,
                                                             float top) {
  for (size_t i = first; i < stop; ++i) {
    const float v = (pa[i] / s + half) + counter_uniform(i, key);  // three float32 roundings, as the reference
    const float c = std::min(std::max(v, 0.0f), top);
    const bool finite = std::fabs(v) <= kMaxFloat;
    out[i - first] = scale_ok && finite ? static_cast<uint8_t>(static_cast<int32_t>(c)) : static_cast<uint8_t>(half);
  }
}

typedef void (*CodesRun)(const float*, uint8_t*, size_t, size_t, float, bool, uint32_t, float, float);

static void codes_generic(const float* pa, uint8_t* out, size_t first, size_t stop, float s, bool scale_ok,
                          uint32_t key, float half, float top) {
  codes_body(pa, out, first, stop, s, scale_ok, key, half, top);
}

#ifdef NEEDLE_X86_DISPATCH
__attribute__((target("avx2,fma"))) static void codes_avx2(const float* pa, uint8_t* out, size_t first, size_t stop,
                                                           float s, bool scale_ok, uint32_t key, float half,
                                                           float top) {
  codes_body(pa, out, first, stop, s, scale_ok, key, half, top);
}
#endif

// The copy for the vector kernels' instruction set (vector_isa(): the widest the CPU has, or what a test set).
static CodesRun codes_run_for_this_cpu() {
#ifdef NEEDLE_X86_DISPATCH
  if (std::strcmp(g_vector->name, "generic") != 0) return codes_avx2;
#endif
  return codes_generic;
}

// codes_body over [first, last), one call per run of elements with the same block and the same upper 32 bits of
// their index (whose hash key they share): out[0, last - first).
static void codes_of_range(CodesRun run, const float* pa, const float* ps, uint8_t* out, size_t first, size_t last,
                           size_t bs, uint32_t seed_key, float half, float top) {
  for (size_t i = first; i < last;) {
    const size_t b = i / bs;
    const uint64_t high = static_cast<uint64_t>(i) >> 32;
    const size_t stop = std::min({last, (b + 1) * bs, static_cast<size_t>((high + 1) << 32)});
    const float s = ps[b];
    run(pa, out + (i - first), i, stop, s, s > 0.0f && s <= kMaxFloat,
        lowbias32(static_cast<uint32_t>(high) ^ seed_key), half, top);
    i = stop;
  }
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
  const CodesRun run = codes_run_for_this_cpu();
  const float top = static_cast<float>((1 << bits) - 2);  // 2h, the largest code
  if (bits == 8) {  // a byte per code: straight into the output, a block a task
    parallel_range(blocks, threads_for(n, false), [&](size_t begin, size_t end) {
      codes_of_range(run, pa, ps, po + begin * bs, begin * bs, std::min(n, end * bs), bs, seed_key, half, top);
    });
    return;
  }
  // Fewer bits: a chunk of whole groups of 8 codes at a time into a buffer, then packed as fewbit.h packs them.
  constexpr size_t kChunk = 1024;  // elements, a multiple of 8
  const size_t nbytes = out.size;
  parallel_range((n + kChunk - 1) / kChunk, threads_for(n, false), [&](size_t begin, size_t end) {
    uint8_t codes[kChunk];
    for (size_t chunk = begin; chunk < end; ++chunk) {
      const size_t first = chunk * kChunk, last = std::min(n, first + kChunk), groups = (last - first + 7) / 8;
      codes_of_range(run, pa, ps, codes, first, last, bs, seed_key, half, top);
      std::fill(codes + (last - first), codes + 8 * groups, uint8_t(0));  // past the end: no code
      for (size_t g = 0; g < groups; ++g) {
        uint64_t group = 0;
        for (int j = 0; j < 8; ++j) group |= uint64_t(codes[8 * g + j]) << (j * bits);
        const size_t at = (first / 8 + g) * static_cast<size_t>(bits);
        for (int byte = 0; byte < bits && at + byte < nbytes; ++byte) {
          po[at + byte] = static_cast<uint8_t>(group >> (8 * byte));
        }
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
  const size_t nbytes = codes.size;
  py::gil_scoped_release release;
  // (code - h) * scale over out[first, last), codes[0, last - first): a loop per block, which vectorizes
  const auto rebuild = [&](const uint8_t* codes_at, size_t first, size_t last) {
    for (size_t i = first; i < last;) {
      const size_t b = i / bs, stop = std::min(last, (b + 1) * bs);
      const float s = ps[b];
      for (size_t k = i; k < stop; ++k) po[k] = (static_cast<float>(codes_at[k - first]) - half) * s;
      i = stop;
    }
  };
  if (bits == 8) {  // a byte per code: read in place, a block a task
    parallel_range((n + bs - 1) / bs, threads_for(n, false), [&](size_t begin, size_t end) {
      rebuild(pc + begin * bs, begin * bs, std::min(n, end * bs));
    });
    return;
  }
  // Fewer bits: a chunk of whole groups of 8 codes unpacked into a buffer, then rebuilt.
  constexpr size_t kChunk = 1024;  // elements, a multiple of 8
  parallel_range((n + kChunk - 1) / kChunk, threads_for(n, false), [&](size_t begin, size_t end) {
    uint8_t unpacked[kChunk];
    for (size_t chunk = begin; chunk < end; ++chunk) {
      const size_t first = chunk * kChunk, last = std::min(n, first + kChunk);
      for (size_t g = 0; g < (last - first + 7) / 8; ++g) {
        const size_t at = (first / 8 + g) * static_cast<size_t>(bits);
        uint64_t group = 0;
        for (int byte = 0; byte < bits && at + byte < nbytes; ++byte) group |= uint64_t(pc[at + byte]) << (8 * byte);
        for (int j = 0; j < 8; ++j) unpacked[8 * g + j] = static_cast<uint8_t>((group >> (j * bits)) & mask);
      }
      rebuild(unpacked, first, last);
    }
  });
}

}  // namespace cpu
}  // namespace needle
