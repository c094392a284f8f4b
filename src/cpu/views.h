// views.h -- copies between strided views and compact buffers, converting dtypes on the way (compact,
// which is also astype, ewise_setitem, scalar_setitem), to and from NumPy (to_numpy, from_numpy), and fill.
#pragma once

#include "array.h"
#include "common.h"
#include "dtypes.h"
#include "walk.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <type_traits>
#include <vector>

namespace needle {
namespace cpu {

// out[i] = a[view element i], converted from From to To (a plain copy when they agree)
template <class From, class To>
static void compact_into(const From* a, To* out, const Walk<1>& v) {
  for_each_run(v, 1, [&](const int64_t* pos, size_t i, int64_t len, const int64_t* step) {
    const From* src = a + pos[0];
    To* dst = out + i;
    if (std::is_same<From, To>::value && step[0] == 1) {
      std::memcpy(static_cast<void*>(dst), src, static_cast<size_t>(len) * sizeof(To));
    } else if (step[0] == 0) {
      std::fill(dst, dst + len, convert<To>(*src));
    } else {
      for (int64_t j = 0; j < len; ++j) dst[j] = convert<To>(src[j * step[0]]);
    }
  });
}

// Calls f(From(), To()) with the storage types of two dtypes.
template <class F>
static void visit_pair(DType from, DType to, F&& f) {
  visit_any(from, [&](auto x) { visit_any(to, [&](auto y) { f(x, y); }); });
}

static void compact(const Array& a, Array& out, const std::vector<int64_t>& shape,
                    const std::vector<int64_t>& strides, int64_t offset) {
  Walk<1> v = make_view("compact", shape, strides, offset, a.size);
  check_size("compact", "out", out.size, v.size);
  visit_pair(a.dtype, out.dtype, [&](auto x, auto y) {
    compact_into(a.data<decltype(x)>(), out.data<decltype(y)>(), v);
  });
}

// A view of out that reaches one element from several indices (a broadcast: stride 0 along an axis longer than 1)
// would keep whichever of their values came last: the write is refused, as NumPy refuses writes to broadcast views.
static void check_no_repeats(const char* fn, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                             size_t size) {
  for (size_t j = 0; j < shape.size() && size > 0; ++j) {
    if (strides[j] == 0 && shape[j] > 1) {
      std::ostringstream msg;
      msg << fn << ": the view of out repeats elements (stride 0 along axis " << j << " of " << shape[j]
          << "): a write through it would keep only one of the values written to each";
      fail(msg.str());
    }
  }
}

static void ewise_setitem(const Array& a, Array& out, const std::vector<int64_t>& shape,
                          const std::vector<int64_t>& strides, int64_t offset) {
  Walk<1> v = make_view("ewise_setitem", shape, strides, offset, out.size);
  check_size("ewise_setitem", "a", a.size, v.size);
  check_no_repeats("ewise_setitem", shape, strides, v.size);
  visit_pair(a.dtype, out.dtype, [&](auto x, auto y) {
    using From = decltype(x);
    using To = decltype(y);
    const From* src0 = a.data<From>();
    To* base = out.data<To>();
    for_each_run(v, 1, [&](const int64_t* pos, size_t i, int64_t len, const int64_t* step) {
      const From* src = src0 + i;
      To* dst = base + pos[0];
      if (std::is_same<From, To>::value && step[0] == 1) {
        // a may be out itself (x[:] = x)
        std::memmove(static_cast<void*>(dst), src, static_cast<size_t>(len) * sizeof(To));
      } else {
        for (int64_t j = 0; j < len; ++j) dst[j * step[0]] = convert<To>(src[j]);
      }
    });
  });
}

static void scalar_setitem(int64_t size, scalar_t val, Array& out, const std::vector<int64_t>& shape,
                           const std::vector<int64_t>& strides, int64_t offset) {
  Walk<1> v = make_view("scalar_setitem", shape, strides, offset, out.size);
  if (size < 0 || static_cast<size_t>(size) != v.size) {
    std::ostringstream msg;
    msg << "scalar_setitem: size is " << size << " but the view has " << v.size << " elements";
    fail(msg.str());
  }
  visit_any(out.dtype, [&](auto t) {
    using T = decltype(t);
    const T value = convert<T>(val);
    T* base = out.data<T>();
    for_each_run(v, 1, [&](const int64_t* pos, size_t, int64_t len, const int64_t* step) {
      T* dst = base + pos[0];
      if (step[0] == 1) {
        std::fill(dst, dst + len, value);
      } else {
        for (int64_t j = 0; j < len; ++j) dst[j * step[0]] = value;
      }
    });
  });
}

static py::array to_numpy(const Array& a, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                          int64_t offset) {
  Walk<1> v = make_view("to_numpy", shape, strides, offset, a.size);
  std::vector<py::ssize_t> np_shape(shape.begin(), shape.end());
  py::array result(py::dtype(info(a.dtype).numpy), np_shape);
  visit_any(a.dtype, [&](auto t) {
    using T = decltype(t);
    compact_into(a.data<T>(), static_cast<T*>(result.mutable_data()), v);
  });
  return result;
}

// to_numpy into `out`, a C-contiguous NumPy array of a's dtype and the view's size, that the caller reuses (offload
// parks values in a pool of host buffers: a fresh NumPy array per value would cost an allocation and its page faults)
static void to_numpy_into(const Array& a, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                          int64_t offset, py::array out) {
  Walk<1> v = make_view("to_numpy_into", shape, strides, offset, a.size);
  if (static_cast<size_t>(out.itemsize()) != a.itemsize || !(out.flags() & py::array::c_style) ||
      !out.writeable()) {
    std::ostringstream msg;
    msg << "to_numpy_into: a " << a.dtype_name() << " array needs a writeable C-contiguous array of " << a.itemsize
        << "-byte elements, got " << out.itemsize() << "-byte elements";
    throw py::type_error(msg.str());
  }
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  check_size("to_numpy_into", "the numpy array", static_cast<size_t>(out.size()), n);
  visit_any(a.dtype, [&](auto t) {
    using T = decltype(t);
    compact_into(a.data<T>(), static_cast<T*>(out.mutable_data()), v);
  });
}

// float32 buffers take any numeric numpy array (converted, as before dtypes existed); other dtypes take the
// storage type's bytes exactly (ndarray.py converts first).
static void from_numpy(py::array a, Array& out) {
  if (out.dtype == DType::f32) {
    auto f = py::array_t<scalar_t, py::array::c_style | py::array::forcecast>::ensure(a);
    if (!f) throw py::type_error("from_numpy: cannot convert the numpy array to float32");
    check_size("from_numpy", "the numpy array", static_cast<size_t>(f.size()), out.size);
    if (out.size) std::memcpy(out.ptr, f.data(), out.size * sizeof(scalar_t));
    return;
  }
  if (static_cast<size_t>(a.itemsize()) != out.itemsize || !(a.flags() & py::array::c_style)) {
    std::ostringstream msg;
    msg << "from_numpy: a " << out.dtype_name() << " buffer needs a C-contiguous array of " << out.itemsize
        << "-byte elements, got " << a.itemsize() << "-byte elements";
    throw py::type_error(msg.str());
  }
  check_size("from_numpy", "the numpy array", static_cast<size_t>(a.size()), out.size);
  if (out.size) std::memcpy(out.ptr, a.data(), out.size * out.itemsize);
}

static void fill(Array& out, scalar_t val) {
  visit_any(out.dtype, [&](auto t) {
    using T = decltype(t);
    std::fill(out.data<T>(), out.data<T>() + out.size, convert<T>(val));
  });
}

}  // namespace cpu
}  // namespace needle
