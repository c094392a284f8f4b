// quantize.h -- block-wise 8-bit quantization (Dettmers et al. 2021): quantize_blockwise,
// dequantize_blockwise, and the parts the 8-bit optimizer (adam.h) shares with them: the nearest-code lookup
// (CodeBuckets), block_absmax and the argument checks.
//
// quantize_blockwise: the n elements of a are cut into blocks of block_size (the last one may be shorter); each
// block is one task (blocks are spread over the threads) that first finds the block's absmax and then maps every
// element x = a[i] / absmax to the index of the nearest value of `code` (256 float32 values, strictly
// ascending), exactly as src/README.md words it.  dequantize_blockwise multiplies back.
#pragma once

#include "array.h"
#include "common.h"
#include "dtypes.h"
#include "threads.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace needle {
namespace cpu {

constexpr size_t CODE_SIZE = 256;

// The nearest code value, fast: a first guess from a table indexed by the upper 16 bits of x's float32 pattern
// (sign, exponent and 7 mantissa bits: 65536 "buckets", each an interval of floats), then a short walk up.
// bucket_floor[k] = the largest j with code[j] <= the smallest float of bucket k (0 if none).  The smallest float
// of a bucket is its pattern with the low 16 bits 0 for a positive sign and all 1 for a negative sign (a larger
// pattern is a larger magnitude).  So for every x in the bucket, lo(x) >= bucket_floor[k], and walking up while
// code[lo + 1] <= x reaches lo(x) exactly: the same lo as a binary search, hence the same bytes as the contract.
// The walk is 0 or 1 steps for the dynamic maps (a bucket is 2^-7 of its magnitude wide, about as wide as their
// densest spacing); any strictly ascending code stays exact, only slower.  Buckets of NaN patterns hold 0, and
// the walk never moves a NaN (it compares false), as the contract wants.  Building the table is one merge of the
// 65536 bucket floors (ascending by value) with the 256 codes.
struct CodeBuckets {
  std::vector<uint8_t> floor_of;  // 65536 entries

  explicit CodeBuckets(const float* code) : floor_of(65536, 0) {
    // Ascending values: negative patterns from 0xFFFF down to 0x8000, then positive ones 0x0000 .. 0x7FFF.
    int j = 0;
    auto fill = [&](uint32_t k) {
      const uint32_t low = (k & 0x8000) ? 0xFFFFu : 0u;
      float smallest;
      const uint32_t bits = (k << 16) | low;
      std::memcpy(&smallest, &bits, sizeof smallest);
      if (smallest != smallest) return;  // a NaN bucket keeps 0
      while (j < 255 && code[j + 1] <= smallest) ++j;
      floor_of[k] = static_cast<uint8_t>(code[j] <= smallest ? j : 0);
    };
    for (uint32_t k = 0xFFFF; k >= 0x8000; --k) fill(k);
    for (uint32_t k = 0; k < 0x8000; ++k) fill(k);
  }

  uint8_t nearest(const float* code, float x) const {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    int lo = floor_of[bits >> 16];
    const int next = lo < 255 ? lo + 1 : 255;
    lo += next != lo && code[next] <= x;  // the usual single step, without a branch to mispredict
    while (lo < 255 && code[lo + 1] <= x) ++lo;  // codes denser than a bucket only
    const int hi = std::min(lo + 1, 255);
    return static_cast<uint8_t>(code[hi] - x < x - code[lo] ? hi : lo);
  }
};

// The tables of the last few codes seen (an optimizer quantizes with the same two maps every step, and building a
// table costs as much as quantizing 50,000 elements).  Looked up by the code's values; called with the GIL held.
static const CodeBuckets& buckets_for(const float* code) {
  struct Entry {
    std::vector<float> code;
    CodeBuckets buckets;
  };
  static std::vector<std::unique_ptr<Entry>> cache;  // most recently used first
  for (size_t k = 0; k < cache.size(); ++k) {
    if (std::equal(code, code + CODE_SIZE, cache[k]->code.begin())) {
      std::rotate(cache.begin(), cache.begin() + k, cache.begin() + k + 1);
      return cache.front()->buckets;
    }
  }
  if (cache.size() == 8) cache.pop_back();
  cache.insert(cache.begin(), std::make_unique<Entry>(Entry{std::vector<float>(code, code + CODE_SIZE),
                                                            CodeBuckets(code)}));
  return cache.front()->buckets;
}

// The largest |a[i]| of a[0..n); for a block holding a NaN, |first NaN| (a NaN, as numpy's max of abs gives).
static float block_absmax(const float* a, size_t n) {
  float m = 0.0f;
  bool nan = false;
  for (size_t i = 0; i < n; ++i) {
    const float v = std::fabs(a[i]);
    m = v > m ? v : m;
    nan |= v != v;
  }
  if (nan) {
    for (size_t i = 0;; ++i)
      if (a[i] != a[i]) return std::fabs(a[i]);
  }
  return m;
}

// One array a blockwise function takes: its name, the dtype it must have and the element count it must have.
struct BlockwiseArg {
  const char* name;
  const Array& array;
  DType dtype;
  size_t size;
};

// The checks of both functions after num_blocks has checked block_size, in the NumPy module's order: the dtypes
// (TypeError naming every array's dtype), then the sizes (ValueError naming the array, its size and the expected
// one).
static void check_blockwise(const char* fn, std::initializer_list<BlockwiseArg> args) {
  bool ok = true;
  for (const BlockwiseArg& x : args) ok = ok && x.array.dtype == x.dtype;
  if (!ok) {
    std::ostringstream want, got;
    for (const BlockwiseArg& x : args) {  // "expects float32 a, float32 code, ..., got a float16, code float32, ..."
      want << (want.tellp() > 0 ? ", " : "") << info(x.dtype).name << " " << x.name;
      got << (got.tellp() > 0 ? ", " : "") << x.name << " " << x.array.dtype_name();
    }
    throw py::type_error(std::string(fn) + ": expects " + want.str() + ", got " + got.str());
  }
  for (const BlockwiseArg& x : args) check_size(fn, x.name, x.array.size, x.size);
}

// ceil(n / block_size), after checking block_size >= 1 (ValueError).
static size_t num_blocks(const char* fn, size_t n, int64_t block_size) {
  if (block_size < 1)
    fail(std::string(fn) + ": block_size must be at least 1, got " + std::to_string(block_size));
  return n == 0 ? 0 : (n - 1) / static_cast<size_t>(block_size) + 1;
}

static void quantize_blockwise(const Array& a, const Array& code, Array& out, Array& absmax, int64_t block_size) {
  const char* fn = "quantize_blockwise";
  const size_t n = a.size, blocks = num_blocks(fn, n, block_size);
  check_blockwise(fn, {{"a", a, DType::f32, n},
                       {"code", code, DType::f32, CODE_SIZE},
                       {"out", out, DType::u8, n},
                       {"absmax", absmax, DType::f32, blocks}});
  const float* pa = a.data<float>();
  const float* pc = code.data<float>();
  uint8_t* po = out.data<uint8_t>();
  float* pm = absmax.data<float>();
  const size_t bs = static_cast<size_t>(block_size);
  const int nthreads = threads_for(n, true);
  const CodeBuckets& buckets = buckets_for(pc);
  py::gil_scoped_release release;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t b = 0; b < static_cast<int64_t>(blocks); ++b) {
    const size_t begin = static_cast<size_t>(b) * bs, end = std::min(n, begin + bs);
    const float m = block_absmax(pa + begin, end - begin);
    pm[b] = m;
    float x[256];  // the block's x = a / absmax, a chunk at a time: the division vectorizes, the lookups don't
    for (size_t i = begin; i < end; i += 256) {
      const size_t len = std::min<size_t>(256, end - i);
      for (size_t k = 0; k < len; ++k) x[k] = m == 0.0f ? 0.0f : pa[i + k] / m;
      for (size_t k = 0; k < len; ++k) po[i + k] = buckets.nearest(pc, x[k]);
    }
  }
}

static void dequantize_blockwise(const Array& q, const Array& code, const Array& absmax, Array& out,
                                 int64_t block_size) {
  const char* fn = "dequantize_blockwise";
  const size_t n = q.size, blocks = num_blocks(fn, n, block_size);
  check_blockwise(fn, {{"q", q, DType::u8, n},
                       {"code", code, DType::f32, CODE_SIZE},
                       {"absmax", absmax, DType::f32, blocks},
                       {"out", out, DType::f32, n}});
  const uint8_t* pq = q.data<uint8_t>();
  const float* pc = code.data<float>();
  const float* pm = absmax.data<float>();
  float* po = out.data<float>();
  const size_t bs = static_cast<size_t>(block_size);
  const int nthreads = threads_for(n, false);
  py::gil_scoped_release release;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t b = 0; b < static_cast<int64_t>(blocks); ++b) {
    const size_t begin = static_cast<size_t>(b) * bs, end = std::min(n, begin + bs);
    const float m = pm[b];
    for (size_t i = begin; i < end; ++i) po[i] = pc[pq[i]] * m;
  }
}

}  // namespace cpu
}  // namespace needle
