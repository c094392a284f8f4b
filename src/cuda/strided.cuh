// strided.cuh -- strided views (shape, strides, offset) and the copies between a view and a compact buffer,
// in every dtype and across dtypes: compact (gather a view, astype), ewise_setitem (scatter into a view),
// scalar_setitem and fill.
//
// Kernels first, then the host side: make_view / make_views build the kernel-side view and check that it stays
// inside its buffer (the cheap second line behind Python's own checks), then the host wrappers launch.
#pragma once

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "array.cuh"
#include "common.cuh"
#include "dtypes.cuh"

namespace needle {
namespace cuda {

// ---- Strided views ----------------------------------------------------------------------------------------
//
// A view (shape, strides, offset) travels to the kernel by value in this fixed-size struct: kernel arguments
// live in a constant bank every thread can read, so no device allocation or copy is needed for it.

constexpr int kMaxDims = 8;

struct StridedView {
  int ndim;
  int64_t shape[kMaxDims];
  int64_t strides[kMaxDims];
  int64_t offset;
};

// Where element i of the compact (row-major) enumeration of a view lives in the underlying buffer.
// The multi-index (idx_0, ..., idx_{d-1}) of i is read off like the digits of a number, last dimension first
// (it varies fastest): idx_{d-1} = i % shape_{d-1}, then i /= shape_{d-1}, then idx_{d-2} = i % shape_{d-2}, ...
// and the element lives at offset + sum_k idx_k * strides_k.
__device__ int64_t strided_index(const StridedView& view, int64_t i) {
  int64_t pos = view.offset;
#pragma unroll
  for (int k = kMaxDims - 1; k >= 0; --k) {
    // Unrolled, so k is a compile-time constant and view.shape[k] is read straight from the kernel
    // arguments; a run-time index would make every thread copy the struct to (slow) local memory.
    if (k < view.ndim) {
      pos += (i % view.shape[k]) * view.strides[k];
      i /= view.shape[k];
    }
  }
  return pos;
}

// out[i] = a[view(i)]: gather a strided view into a compact buffer, converted to out's type (astype).
template <typename In, typename Out>
__global__ void compact_kernel(const In* a, Out* out, int64_t n, StridedView view) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = convert<Out>(a[strided_index(view, i)]);
}

// out[view(i)] = a[i]: the inverse scatter.
template <typename In, typename Out>
__global__ void ewise_setitem_kernel(const In* a, Out* out, int64_t n, StridedView view) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[strided_index(view, i)] = convert<Out>(a[i]);
}

// out[view(i)] = val (already converted to T on the host).
template <typename T>
__global__ void scalar_setitem_kernel(T val, T* out, int64_t n, StridedView view) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[strided_index(view, i)] = val;
}

template <typename T>
__global__ void fill_kernel(T* out, int64_t n, T val) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = val;
}

// ---- Views, built and checked on the host -----------------------------------------------------------------

// Builds the kernel-side view and checks that every element it reaches lies inside a buffer of buffer_size.
// Returns the number of elements of the view in *count.
StridedView make_view(const char* fn, size_t buffer_size, const std::vector<int64_t>& shape,
                      const std::vector<int64_t>& strides, int64_t offset, int64_t* count) {
  if (shape.size() != strides.size()) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": shape and strides differ in length");
  }
  if (shape.size() > static_cast<size_t>(kMaxDims)) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": " + std::to_string(shape.size()) +
                          " dimensions, at most " + std::to_string(kMaxDims) + " are supported");
  }
  StridedView view{};
  view.ndim = static_cast<int>(shape.size());
  view.offset = offset;
  int64_t lowest = offset;  // smallest and largest buffer positions the view reaches
  int64_t highest = offset;
  bool overflow = false;  // as the CPU backend's make_walk: a wrapped-around reach could look in bounds
  for (int k = 0; k < view.ndim; ++k) {
    if (shape[k] < 0) throw py::value_error(std::string("needle cuda: ") + fn + ": negative shape");
    view.shape[k] = shape[k];
    view.strides[k] = strides[k];
    if (shape[k] > 0) {
      int64_t span;  // from idx_k = 0 to idx_k = shape_k - 1
      overflow |= __builtin_mul_overflow(shape[k] - 1, strides[k], &span);
      overflow |= __builtin_add_overflow(span < 0 ? lowest : highest, span, span < 0 ? &lowest : &highest);
    }
  }
  *count = 1;
  for (int k = 0; k < view.ndim; ++k) {
    if (__builtin_mul_overflow(*count, shape[k], count)) {
      throw py::value_error(std::string("needle cuda: ") + fn + ": shape is too large");
    }
  }
  if (*count > 0 && (overflow || lowest < 0 || highest >= as_int64(buffer_size))) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": view reaches elements [" +
                          std::to_string(lowest) + ", " + std::to_string(highest) + "] of a buffer of " +
                          std::to_string(buffer_size) + " elements");
  }
  return view;
}

// One operand of an element-wise op on strided views: its strides and offset over the common shape, and the
// buffer it must stay inside.
struct Operand {
  const char* what;
  const std::vector<int64_t>* strides;
  int64_t offset;
  size_t buffer_size;
};

// Kernel-side views of N operands over one shape, simplified together (as the CPU backend does): dimensions
// of extent 1 are dropped, and neighbouring dimensions j, j+1 are merged when every operand has
// strides[j] == strides[j+1] * shape[j+1].  Neither changes which elements are visited nor their order, and
// fewer dimensions mean fewer divisions in strided_index (compact operands collapse to one dimension).
// Each simplified view is then checked against its buffer by make_view.  Returns the element count in *count.
template <int N>
void make_views(const char* fn, const std::vector<int64_t>& shape, const Operand (&ops)[N], StridedView (&views)[N],
                int64_t* count) {
  std::vector<int64_t> merged_shape;
  std::vector<int64_t> merged_strides[N];
  for (int k = 0; k < N; ++k) {
    if (ops[k].strides->size() != shape.size()) {
      throw py::value_error(std::string("needle cuda: ") + fn + ": " + ops[k].what +
                            " has strides of another rank than the shape");
    }
  }
  for (size_t j = 0; j < shape.size(); ++j) {
    if (shape[j] == 1) continue;
    bool merge = !merged_shape.empty() && shape[j] > 0 && merged_shape.back() > 0;
    for (int k = 0; k < N && merge; ++k) merge = merged_strides[k].back() == (*ops[k].strides)[j] * shape[j];
    if (merge) {
      merged_shape.back() *= shape[j];
      for (int k = 0; k < N; ++k) merged_strides[k].back() = (*ops[k].strides)[j];
    } else {
      merged_shape.push_back(shape[j]);
      for (int k = 0; k < N; ++k) merged_strides[k].push_back((*ops[k].strides)[j]);
    }
  }
  for (int k = 0; k < N; ++k) {
    views[k] = make_view(fn, ops[k].buffer_size, merged_shape, merged_strides[k], ops[k].offset, count);
  }
}

void check_out(const char* fn, const CudaArray& out, int64_t count, const CudaArray& a, const CudaArray* b) {
  check_size(fn, "out", out.size, static_cast<size_t>(count));
  if (out.size != 0 && (out.ptr == a.ptr || (b != nullptr && out.ptr == b->ptr))) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": out must not be one of the inputs");
  }
}

// ---- Host wrappers: copies and conversions (every dtype) --------------------------------------------------

void compact(const CudaArray& a, CudaArray& out, const std::vector<int64_t>& shape,
             const std::vector<int64_t>& strides, int64_t offset) {
  int64_t n = 0;
  const StridedView view = make_view("compact", a.size, shape, strides, offset, &n);
  check_size("compact", "out", out.size, static_cast<size_t>(n));
  if (n == 0) return;  // a grid of zero blocks is an invalid launch
  visit_dtype(a.dtype, [&](auto in_tag) {
    visit_dtype(out.dtype, [&](auto out_tag) {
      using In = TypeOf<decltype(in_tag)>;
      using Out = TypeOf<decltype(out_tag)>;
      compact_kernel<<<grid_for(n), kBlockSize>>>(data<In>(a), data<Out>(out), n, view);
    });
  });
  check_kernel("compact");
}

void ewise_setitem(const CudaArray& a, CudaArray& out, const std::vector<int64_t>& shape,
                   const std::vector<int64_t>& strides, int64_t offset) {
  int64_t n = 0;
  const StridedView view = make_view("ewise_setitem", out.size, shape, strides, offset, &n);
  check_size("ewise_setitem", "a", a.size, static_cast<size_t>(n));
  // A view that reaches one element from several indices (a broadcast: stride 0 along an axis longer than 1)
  // would keep whichever value came last: refused, as by the CPU backend and NumPy's broadcast views.
  for (size_t k = 0; k < shape.size() && n > 0; ++k) {
    if (strides[k] == 0 && shape[k] > 1) {
      throw py::value_error("needle cuda: ewise_setitem: the view of out repeats elements (stride 0 along axis " +
                            std::to_string(k) + " of " + std::to_string(shape[k]) +
                            "): a write through it would keep only one of the values written to each");
    }
  }
  if (n == 0) return;
  visit_dtype(a.dtype, [&](auto in_tag) {
    visit_dtype(out.dtype, [&](auto out_tag) {
      using In = TypeOf<decltype(in_tag)>;
      using Out = TypeOf<decltype(out_tag)>;
      ewise_setitem_kernel<<<grid_for(n), kBlockSize>>>(data<In>(a), data<Out>(out), n, view);
    });
  });
  check_kernel("ewise_setitem");
}

// The value of fill and scalar_setitem, read as the NumPy reference's `convert` reads it: an integer (a Python
// or NumPy int, or a bool) stays an integer, so an integer buffer receives it exactly (saturated); anything
// else is a float and becomes a float32 first, like every Python float in this module.
struct ScalarValue {
  bool is_integer;
  int64_t integer;  // when is_integer
  float real;       // otherwise
};

ScalarValue read_scalar(const py::object& val) {
  if (PyIndex_Check(val.ptr())) {  // ints, bools and NumPy integers; floats have no __index__
    const py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(val.ptr()));
    if (!index) throw py::error_already_set();
    int overflow = 0;
    const long long integer = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    if (overflow == 0) return {true, integer, 0.0f};
    // Past int64 it is read as a float (NumPy makes an object array of it, then a float32 of that).
  }
  const double real = PyFloat_AsDouble(val.ptr());
  if (real == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  return {false, 0, static_cast<float>(real)};
}

// That value in storage type T, converted once on the host with the kernels' own from_float.
template <typename T>
T scalar_to(const ScalarValue& val) {
  if (!val.is_integer) return from_float<T>(val.real);
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(std::clamp<int64_t>(val.integer, IntRange<T>::lo, IntRange<T>::hi));
  } else {
    return from_float<T>(static_cast<float>(val.integer));
  }
}

void scalar_setitem(size_t size, const py::object& val, CudaArray& out, const std::vector<int64_t>& shape,
                    const std::vector<int64_t>& strides, int64_t offset) {
  int64_t n = 0;
  const StridedView view = make_view("scalar_setitem", out.size, shape, strides, offset, &n);
  check_size("scalar_setitem", "the view", static_cast<size_t>(n), size);
  const ScalarValue value = read_scalar(val);
  if (n == 0) return;
  visit_dtype(out.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    scalar_setitem_kernel<<<grid_for(n), kBlockSize>>>(scalar_to<T>(value), data<T>(out), n, view);
  });
  check_kernel("scalar_setitem");
}

void fill(CudaArray& out, const py::object& val) {
  const ScalarValue value = read_scalar(val);
  const int64_t n = as_int64(out.size);
  if (n == 0) return;
  visit_dtype(out.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    fill_kernel<<<grid_for(n), kBlockSize>>>(data<T>(out), n, scalar_to<T>(value));
  });
  check_kernel("fill");
}

}  // namespace cuda
}  // namespace needle
