// reduce.h -- row reductions: reduce_sum, reduce_max and reduce_logsumexp of compact a viewed as
// (out.size, reduce_size), on the vector kernels of vector_math.h.
#pragma once

#include "array.h"
#include "common.h"
#include "dtypes.h"
#include "threads.h"
#include "vector_math.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace needle {
namespace cpu {

static void check_reduce(const char* fn, const Array& a, const Array& out, int64_t reduce_size) {
  if (reduce_size < 0) fail(std::string(fn) + ": reduce_size must be >= 0");
  if (checked_product(fn, "a", out.size, reduce_size) != a.size) {
    std::ostringstream msg;
    msg << fn << ": a has " << a.size << " elements, expected out.size * reduce_size = " << out.size << " * "
        << reduce_size;
    fail(msg.str());
  }
}

// A 16-bit row widened into the calling thread's float buffer (float32 rows are used in place).
template <class T>
static const float* row_as_float(const T* row, size_t n) {
  if constexpr (std::is_same<T, float>::value) {
    return row;
  } else {
    static thread_local std::vector<float> buf;
    if (buf.size() < n) buf.resize(n);
    for (size_t j = 0; j < n; ++j) buf[j] = to_float(row[j]);
    return buf.data();
  }
}

// Rows are independent: split over threads once there is enough to read.
static void reduce_rows(const char* fn, const Array& a, Array& out, size_t r, scalar_t (*row_fn)(const scalar_t*, int64_t),
                        int nthreads) {
  visit_float(same_float_dtype(fn, {&a, &out}), [&](auto t) {
    using T = decltype(t);
    const T* pa = a.data<T>();
    T* po = out.data<T>();
    parallel_range(out.size, nthreads, [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i)
        po[i] = from_float<T>(row_fn(row_as_float(pa + i * r, r), static_cast<int64_t>(r)));
    });
  });
}

static scalar_t row_sum(const scalar_t* row, int64_t n) { return static_cast<scalar_t>(g_vector->sum(row, n)); }
static scalar_t row_max(const scalar_t* row, int64_t n) { return g_vector->max(row, n); }

// Sums accumulate in double (sum_run): more accurate than a float chain.
static void reduce_sum(const Array& a, Array& out, int64_t reduce_size) {
  check_reduce("reduce_sum", a, out, reduce_size);
  reduce_rows("reduce_sum", a, out, static_cast<size_t>(reduce_size), row_sum,
              a.size >= PARALLEL_CHEAP / 4 ? num_threads() : 1);
}

// Max of each row; a NaN anywhere in a row gives NaN, as numpy's max does.
static void reduce_max(const Array& a, Array& out, int64_t reduce_size) {
  check_reduce("reduce_max", a, out, reduce_size);
  if (reduce_size == 0 && out.size != 0) fail("reduce_max: cannot reduce over zero elements");
  reduce_rows("reduce_max", a, out, static_cast<size_t>(reduce_size), row_max,
              a.size >= PARALLEL_CHEAP / 4 ? num_threads() : 1);
}

// log Σ_j exp(a[i, j]) of each row, max-shifted: m + log Σ exp(a - m), so exp never overflows.  A row whose
// maximum is not finite gives that maximum (+inf, -inf for a row of -inf) or NaN.
static scalar_t row_logsumexp(const scalar_t* row, int64_t n) {
  const scalar_t m = g_vector->max(row, n);
  if (!std::isfinite(m)) return m;
  return m + static_cast<scalar_t>(std::log(g_vector->sum_exp(row, n, m)));
}

static void reduce_logsumexp(const Array& a, Array& out, int64_t reduce_size) {
  check_reduce("reduce_logsumexp", a, out, reduce_size);
  if (reduce_size == 0 && out.size != 0) fail("reduce_logsumexp: cannot reduce over zero elements");
  reduce_rows("reduce_logsumexp", a, out, static_cast<size_t>(reduce_size), row_logsumexp,
              threads_for(a.size, true));
}

}  // namespace cpu
}  // namespace needle
