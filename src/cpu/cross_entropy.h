// cross_entropy.h -- softmax_xent_grad, the fused gradient of the softmax cross-entropy loss: reduce.h's
// logsumexp and gather.h's index check, row by row.
#pragma once

#include "array.h"
#include "common.h"
#include "dtypes.h"
#include "gather.h"
#include "reduce.h"
#include "threads.h"
#include "vector_math.h"

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace needle {
namespace cpu {

// The gradient of the softmax cross-entropy loss_i = logsumexp(a[i]) - a[i, idx[i]] for an upstream g (one
// value per row): out[i, j] = g[i] * (softmax(a[i])_j - [j == idx[i]]).  Row by row, so the row stays in cache
// through the five sweeps (max, Σ exp, a - lse, exp, scale) and the logits are read from memory once, with no
// temporary array.
static void softmax_xent_grad(const Array& a, const Array& idx, const Array& g, Array& out, int64_t row_size) {
  if (row_size <= 0) fail("softmax_xent_grad: row_size must be positive");
  const size_t r = static_cast<size_t>(row_size);
  check_extents("softmax_xent_grad", "a", a.size, idx.size, r);
  check_size("softmax_xent_grad", "g", g.size, idx.size);
  check_extents("softmax_xent_grad", "out", out.size, idx.size, r);
  const DType dt = same_float_dtype("softmax_xent_grad", {&a, &g, &out});
  std::vector<size_t> cols = check_indices("softmax_xent_grad", idx, r);
  visit_float(dt, [&](auto t) {
    using T = decltype(t);
    parallel_range(idx.size, threads_for(a.size, true), [&](size_t begin, size_t end) {
      // float32 rows are computed in out itself; 16-bit ones in a float row buffer, rounded once at the end.
      std::vector<float> buf(std::is_same<T, float>::value ? 0 : r);
      for (size_t i = begin; i < end; ++i) {
        const float* row = row_as_float(a.data<T>() + i * r, r);
        float* o = std::is_same<T, float>::value ? reinterpret_cast<float*>(out.data<T>() + i * r) : buf.data();
        const scalar_t lse = row_logsumexp(row, row_size);
        for (size_t j = 0; j < r; ++j) o[j] = row[j] - lse;
        g_vector->exp(o, o, row_size);
        const scalar_t gi = to_float(g.data<T>()[i]);
        for (size_t j = 0; j < r; ++j) o[j] *= gi;
        o[cols[i]] -= gi;
        if constexpr (!std::is_same<T, float>::value)
          for (size_t j = 0; j < r; ++j) out.data<T>()[i * r + j] = from_float<T>(o[j]);
      }
    });
  });
}

}  // namespace cpu
}  // namespace needle
