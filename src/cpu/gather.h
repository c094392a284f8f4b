// gather.h -- gathers and scatters by index: whole rows (take_rows, scatter_add_rows: embeddings) and one
// element per row (take_along_rows, scatter_along_rows), and check_indices, which turns an index array into
// row numbers or raises IndexError.
#pragma once

#include "array.h"
#include "common.h"
#include "dtypes.h"

#include <pybind11/pybind11.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace needle {
namespace cpu {

// Converts every idx value to a row (or column) number, raising IndexError (before anything is written) for a
// value that is not an integer or not in [0, rows).
static std::vector<size_t> check_indices(const char* fn, const Array& idx, size_t rows) {
  std::vector<double> values(idx.size);  // double holds every int32 exactly
  visit_any(idx.dtype, [&](auto t) {
    using T = decltype(t);
    for (size_t i = 0; i < idx.size; ++i) {
      if constexpr (std::is_integral<T>::value) {
        values[i] = static_cast<double>(idx.data<T>()[i]);
      } else {
        values[i] = to_float(idx.data<T>()[i]);
      }
    }
  });
  std::vector<size_t> out(idx.size);
  for (size_t i = 0; i < idx.size; ++i) {
    const double v = values[i];
    const bool integer = std::isfinite(v) && v == std::floor(v);
    if (!integer || v < 0.0 || v >= static_cast<double>(rows)) {
      std::ostringstream msg;
      msg << fn << ": index " << v << (integer ? " is out of range for " : " is not an integer, for ") << rows
          << " rows";
      throw py::index_error(msg.str());
    }
    out[i] = static_cast<size_t>(v);
  }
  return out;
}

static void check_row_size(const char* fn, int64_t row_size, const Array& table) {
  if (row_size <= 0) fail(std::string(fn) + ": row_size must be positive");
  if (table.size % static_cast<size_t>(row_size) != 0) {
    std::ostringstream msg;
    msg << fn << ": a buffer of " << table.size << " elements is not a whole number of rows of " << row_size;
    fail(msg.str());
  }
}

// out[i, :] = a[idx[i], :]
static void take_rows(const Array& a, const Array& idx, Array& out, int64_t row_size) {
  check_row_size("take_rows", row_size, a);
  const size_t r = static_cast<size_t>(row_size);
  check_extents("take_rows", "out", out.size, idx.size, r);
  if (a.dtype != out.dtype)
    throw py::type_error("take_rows: a is " + a.dtype_name() + " but out is " + out.dtype_name());
  std::vector<size_t> rows = check_indices("take_rows", idx, a.size / r);
  const char* src = reinterpret_cast<const char*>(a.ptr);
  char* dst = reinterpret_cast<char*>(out.ptr);
  const size_t row_bytes = r * a.itemsize;
  for (size_t i = 0; i < rows.size(); ++i) std::memcpy(dst + i * row_bytes, src + rows[i] * row_bytes, row_bytes);
}

// out[idx[i], :] += src[i, :], in order of i
static void scatter_add_rows(const Array& src, const Array& idx, Array& out, int64_t row_size) {
  check_row_size("scatter_add_rows", row_size, out);
  const size_t r = static_cast<size_t>(row_size);
  check_extents("scatter_add_rows", "src", src.size, idx.size, r);
  const DType dt = same_float_dtype("scatter_add_rows", {&src, &out});
  std::vector<size_t> rows = check_indices("scatter_add_rows", idx, out.size / r);
  visit_float(dt, [&](auto t) {
    using T = decltype(t);
    for (size_t i = 0; i < rows.size(); ++i) {
      T* dst = out.data<T>() + rows[i] * r;
      const T* s = src.data<T>() + i * r;
      for (size_t j = 0; j < r; ++j) dst[j] = from_float<T>(to_float(dst[j]) + to_float(s[j]));
    }
  });
}

// out[i] = a[i, idx[i]], a viewed as (idx.size, row_size)
static void take_along_rows(const Array& a, const Array& idx, Array& out, int64_t row_size) {
  if (row_size < 0) fail("take_along_rows: row_size must be >= 0");
  const size_t r = static_cast<size_t>(row_size);
  check_extents("take_along_rows", "a", a.size, idx.size, r);
  check_size("take_along_rows", "out", out.size, idx.size);
  const DType dt = same_float_dtype("take_along_rows", {&a, &out});
  std::vector<size_t> cols = check_indices("take_along_rows", idx, r);
  visit_float(dt, [&](auto t) {
    using T = decltype(t);
    for (size_t i = 0; i < cols.size(); ++i) out.data<T>()[i] = a.data<T>()[i * r + cols[i]];
  });
}

// out[i, idx[i]] += src[i], out viewed as (idx.size, row_size)
static void scatter_along_rows(const Array& src, const Array& idx, Array& out, int64_t row_size) {
  if (row_size < 0) fail("scatter_along_rows: row_size must be >= 0");
  const size_t r = static_cast<size_t>(row_size);
  check_size("scatter_along_rows", "src", src.size, idx.size);
  check_extents("scatter_along_rows", "out", out.size, idx.size, r);
  const DType dt = same_float_dtype("scatter_along_rows", {&src, &out});
  std::vector<size_t> cols = check_indices("scatter_along_rows", idx, r);
  visit_float(dt, [&](auto t) {
    using T = decltype(t);
    for (size_t i = 0; i < cols.size(); ++i) {
      T& o = out.data<T>()[i * r + cols[i]];
      o = from_float<T>(to_float(o) + to_float(src.data<T>()[i]));
    }
  });
}

}  // namespace cpu
}  // namespace needle
