// gather_scatter.cuh -- rows picked and summed by index (embeddings, labels): take_rows, scatter_add_rows,
// take_along_rows, scatter_along_rows.  Indices arrive in any dtype; the host copies them back and checks each
// is an integer in range (check_row_indices) before any kernel could read out of bounds.  Scatters sum in index
// order, without atomics, so results are reproducible.
//
// Kernels first, then the host wrappers.
#pragma once

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "array.cuh"
#include "common.cuh"
#include "dtypes.cuh"

namespace needle {
namespace cuda {

// ---- Row gather / scatter (embeddings) --------------------------------------------------------------------
// Indices arrive in any dtype (TIdx), already checked on the host to be integers in range; to_index reads them.

// out[i, j] = a[idx[i], j]; one thread per output element, consecutive threads along a row (coalesced).
// A plain copy, so it works for every dtype (a and out of one dtype T).
template <typename T, typename TIdx>
__global__ void take_rows_kernel(const T* a, const TIdx* idx, T* out, int64_t n, int64_t row_size) {
  for (int64_t e = first_index(); e < n; e += grid_stride()) {
    const int64_t i = e / row_size;
    const int64_t j = e % row_size;
    out[e] = a[to_index(idx[i]) * row_size + j];
  }
}

// out[idx[i], j] += src[i, j] for i = 0, 1, 2, ... in order.  One thread per column j walks all i itself:
// with repeated indices, atomicAdd from many threads would sum in a different order each run (float addition
// is not associative), so results would not be reproducible.  Here every column is summed in index order,
// each addition rounded to T as a NumPy `out[r] += src[i]` would be.
template <typename T, typename TIdx>
__global__ void scatter_add_rows_kernel(const T* src, const TIdx* idx, T* out, int64_t num_idx, int64_t row_size) {
  for (int64_t j = first_index(); j < row_size; j += grid_stride()) {
    for (int64_t i = 0; i < num_idx; ++i) {
      T& target = out[to_index(idx[i]) * row_size + j];
      target = from_float<T>(to_float(target) + to_float(src[i * row_size + j]));
    }
  }
}

// out[i] = a[i, idx[i]] (a viewed as (n, row_size)): the logit at each row's label, with no one-hot matrix.
template <typename T, typename TIdx>
__global__ void take_along_rows_kernel(const T* a, const TIdx* idx, T* out, int64_t n, int64_t row_size) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    out[i] = a[i * row_size + to_index(idx[i])];
  }
}

// out[i, idx[i]] += src[i]: each row is touched by exactly one thread, so no atomics are needed.
template <typename T, typename TIdx>
__global__ void scatter_along_rows_kernel(const T* src, const TIdx* idx, T* out, int64_t n, int64_t row_size) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    T& target = out[i * row_size + to_index(idx[i])];
    target = from_float<T>(to_float(target) + to_float(src[i]));
  }
}

// ---- Host wrappers: index checks, then one launch each ----------------------------------------------------

// Formats an index value for an error message: 7 rather than 7.000000, but 2.5 and nan as they are.
std::string format_index(double value) {
  std::ostringstream s;
  if (std::isfinite(value) && value == std::floor(value)) {
    s << static_cast<long long>(value);
  } else {
    s << value;
  }
  return s.str();
}

// An index as the host reads it: exactly, int32 included (a double holds every value of every storage type).
template <typename T>
double index_value(T x) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<double>(x);
  } else {
    return static_cast<double>(to_float(x));
  }
}

// Copies the indices (of any dtype) to the host and checks each is an integer in [0, rows).  The copy waits for
// the device; that cost buys a Python IndexError *before* any kernel could read out of bounds.
void check_row_indices(const char* fn, const CudaArray& idx, int64_t rows) {
  if (idx.size == 0) return;
  visit_dtype(idx.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    std::vector<T> host(idx.size);
    check_cuda(cudaMemcpy(host.data(), idx.ptr, idx.size * sizeof(T), cudaMemcpyDeviceToHost),
               "cudaMemcpy (reading row indices)");
    for (size_t i = 0; i < host.size(); ++i) {
      const double v = index_value(host[i]);
      if (!std::isfinite(v) || v != std::floor(v)) {
        throw py::index_error(std::string("needle cuda: ") + fn + ": index " + format_index(v) + " (idx[" +
                              std::to_string(i) + "]) is not an integer");
      }
      if (v < 0.0 || v >= static_cast<double>(rows)) {  // double: exact for any row count
        throw py::index_error(std::string("needle cuda: ") + fn + ": index " + format_index(v) + " (idx[" +
                              std::to_string(i) + "]) is out of range for " + std::to_string(rows) + " rows");
      }
    }
  });
}

// Calls launch(TypeTag<T>(), TypeTag<TIdx>()) for the floating dtype of the data and any dtype of idx.
template <typename Launch>
void visit_floating_and_index(DType data_dtype, DType idx_dtype, Launch&& launch) {
  visit_floating(data_dtype, [&](auto data_tag) {
    visit_dtype(idx_dtype, [&](auto idx_tag) { launch(data_tag, idx_tag); });
  });
}

void take_rows(const CudaArray& a, const CudaArray& idx, CudaArray& out, size_t row_size) {
  if (a.dtype != out.dtype) {
    throw py::type_error("needle cuda: take_rows: expects a and out of one dtype, got " +
                         describe_dtypes({{"a", a}, {"out", out}}));
  }
  if (row_size == 0) throw py::value_error("needle cuda: take_rows: row_size must be positive");
  if (a.size % row_size != 0) {
    throw py::value_error("needle cuda: take_rows: a has " + std::to_string(a.size) +
                          " elements, not a multiple of row_size " + std::to_string(row_size));
  }
  check_extents("take_rows", "out", out.size, idx.size, row_size);
  check_row_indices("take_rows", idx, as_int64(a.size / row_size));
  const int64_t n = as_int64(out.size);
  if (n == 0) return;
  // A copy: every dtype of a (not only the floating ones), with indices of every dtype.
  visit_dtype(a.dtype, [&](auto data_tag) {
    visit_dtype(idx.dtype, [&](auto idx_tag) {
      using T = TypeOf<decltype(data_tag)>;
      using TIdx = TypeOf<decltype(idx_tag)>;
      take_rows_kernel<<<grid_for(n), kBlockSize>>>(data<T>(a), data<TIdx>(idx), data<T>(out), n,
                                                    as_int64(row_size));
    });
  });
  check_kernel("take_rows");
}

void scatter_add_rows(const CudaArray& src, const CudaArray& idx, CudaArray& out, size_t row_size) {
  check_floating("scatter_add_rows", {{"src", src}, {"out", out}});
  if (row_size == 0) throw py::value_error("needle cuda: scatter_add_rows: row_size must be positive");
  if (out.size % row_size != 0) {
    throw py::value_error("needle cuda: scatter_add_rows: out has " + std::to_string(out.size) +
                          " elements, not a multiple of row_size " + std::to_string(row_size));
  }
  check_extents("scatter_add_rows", "src", src.size, idx.size, row_size);
  check_row_indices("scatter_add_rows", idx, as_int64(out.size / row_size));
  if (idx.size == 0) return;
  const int64_t columns = as_int64(row_size);
  visit_floating_and_index(out.dtype, idx.dtype, [&](auto data_tag, auto idx_tag) {
    using T = TypeOf<decltype(data_tag)>;
    using TIdx = TypeOf<decltype(idx_tag)>;
    scatter_add_rows_kernel<<<grid_for(columns), kBlockSize>>>(data<T>(src), data<TIdx>(idx), data<T>(out),
                                                               as_int64(idx.size), columns);
  });
  check_kernel("scatter_add_rows");
}

void take_along_rows(const CudaArray& a, const CudaArray& idx, CudaArray& out, size_t row_size) {
  check_floating("take_along_rows", {{"a", a}, {"out", out}});
  if (row_size == 0) throw py::value_error("needle cuda: take_along_rows: row_size must be positive");
  check_extents("take_along_rows", "a", a.size, idx.size, row_size);
  check_size("take_along_rows", "out", out.size, idx.size);
  check_row_indices("take_along_rows", idx, as_int64(row_size));
  const int64_t n = as_int64(idx.size);
  if (n == 0) return;
  visit_floating_and_index(a.dtype, idx.dtype, [&](auto data_tag, auto idx_tag) {
    using T = TypeOf<decltype(data_tag)>;
    using TIdx = TypeOf<decltype(idx_tag)>;
    take_along_rows_kernel<<<grid_for(n), kBlockSize>>>(data<T>(a), data<TIdx>(idx), data<T>(out), n,
                                                        as_int64(row_size));
  });
  check_kernel("take_along_rows");
}

void scatter_along_rows(const CudaArray& src, const CudaArray& idx, CudaArray& out, size_t row_size) {
  check_floating("scatter_along_rows", {{"src", src}, {"out", out}});
  if (row_size == 0) throw py::value_error("needle cuda: scatter_along_rows: row_size must be positive");
  check_extents("scatter_along_rows", "out", out.size, idx.size, row_size);
  check_size("scatter_along_rows", "src", src.size, idx.size);
  check_row_indices("scatter_along_rows", idx, as_int64(row_size));
  const int64_t n = as_int64(idx.size);
  if (n == 0) return;
  visit_floating_and_index(out.dtype, idx.dtype, [&](auto data_tag, auto idx_tag) {
    using T = TypeOf<decltype(data_tag)>;
    using TIdx = TypeOf<decltype(idx_tag)>;
    scatter_along_rows_kernel<<<grid_for(n), kBlockSize>>>(data<T>(src), data<TIdx>(idx), data<T>(out), n,
                                                           as_int64(row_size));
  });
  check_kernel("scatter_along_rows");
}

}  // namespace cuda
}  // namespace needle
