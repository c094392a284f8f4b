// elementwise.cuh -- element-wise operations: one functor per operation (AddOp, ..., TanhOp), generic kernels
// over compact arrays of every floating dtype (ewise_*, scalar_*, ewise_log/exp/tanh), and the same over
// strided float32 views (ewise_strided, scalar_strided, unary_strided).
//
// Kernels first, then the host wrappers.  The functors are also the reductions' combiners (reduce.cuh).
#pragma once

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "array.cuh"
#include "common.cuh"
#include "dtypes.cuh"
#include "strided.cuh"

namespace needle {
namespace cuda {

// ---- Element-wise operations ------------------------------------------------------------------------------
//
// One small functor per operation and three generic kernels (array-array, array-scalar, unary).  The functor
// is a template argument, so the compiler inlines it: each instantiation is as fast as a hand-written kernel.
// The functors work on float; the kernels load each element with to_float and store with from_float<T>.

struct AddOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct SubOp {
  __device__ float operator()(float a, float b) const { return a - b; }
};
struct MulOp {
  __device__ float operator()(float a, float b) const { return a * b; }
};
struct DivOp {
  __device__ float operator()(float a, float b) const { return a / b; }
};
// a^0.5 is a correctly rounded square root (CUDA's powf may be 2 ulp off), as NumPy and the C++ backend compute it.
struct PowerOp {
  __device__ float operator()(float a, float b) const { return b == 0.5f ? __fsqrt_rn(a) : powf(a, b); }
};
// NaN wins, as in numpy.maximum (fmaxf would drop it): the NumPy backend is the specification.
struct MaximumOp {
  __device__ float operator()(float a, float b) const { return (a > b || isnan(a)) ? a : b; }
};
struct EqOp {
  __device__ float operator()(float a, float b) const { return a == b ? 1.0f : 0.0f; }
};
struct GeOp {
  __device__ float operator()(float a, float b) const { return a >= b ? 1.0f : 0.0f; }
};
struct GtOp {
  __device__ float operator()(float a, float b) const { return a > b ? 1.0f : 0.0f; }
};
struct LogOp {
  __device__ float operator()(float a) const { return logf(a); }
};
struct ExpOp {
  __device__ float operator()(float a) const { return expf(a); }
};
struct TanhOp {
  __device__ float operator()(float a) const { return tanhf(a); }
};

template <typename T, typename Op>
__global__ void ewise_kernel(const T* a, const T* b, T* out, int64_t n, Op op) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = from_float<T>(op(to_float(a[i]), to_float(b[i])));
}

template <typename T, typename Op>
__global__ void scalar_kernel(const T* a, float val, T* out, int64_t n, Op op) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = from_float<T>(op(to_float(a[i]), val));
}

template <typename T, typename Op>
__global__ void unary_kernel(const T* a, T* out, int64_t n, Op op) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = from_float<T>(op(to_float(a[i])));
}

// The same three on strided views (ewise_strided, scalar_strided, unary_strided): every operand is a view of
// the output's shape, read at strided_index(view, i), so a broadcast operand (stride 0) or a transposed one is
// never copied first.  out is compact: consecutive threads still write consecutive floats.  float32 only
// (ndarray.py hands non-compact 16-bit operands to the compact kernels above as compact copies).
template <typename Op>
__global__ void ewise_strided_kernel(const float* a, StridedView va, const float* b, StridedView vb, float* out,
                                     int64_t n, Op op) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    out[i] = op(a[strided_index(va, i)], b[strided_index(vb, i)]);
  }
}

template <typename Op>
__global__ void scalar_strided_kernel(const float* a, StridedView va, float val, float* out, int64_t n, Op op) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = op(a[strided_index(va, i)], val);
}

template <typename Op>
__global__ void unary_strided_kernel(const float* a, StridedView va, float* out, int64_t n, Op op) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = op(a[strided_index(va, i)]);
}

// ---- Host wrappers: strided views (float32 only) ----------------------------------------------------------

// Calls visit(op) with the functor of the binary operation named `name`.
template <typename Visit>
void with_binary_op(const char* fn, const std::string& name, Visit visit) {
  if (name == "add") return visit(AddOp());
  if (name == "sub") return visit(SubOp());
  if (name == "mul") return visit(MulOp());
  if (name == "div") return visit(DivOp());
  if (name == "power") return visit(PowerOp());
  if (name == "maximum") return visit(MaximumOp());
  if (name == "eq") return visit(EqOp());
  if (name == "ge") return visit(GeOp());
  if (name == "gt") return visit(GtOp());
  throw py::value_error(std::string("needle cuda: ") + fn + ": unknown op '" + name +
                        "' (expected add, sub, mul, div, power, maximum, eq, ge or gt)");
}

void ewise_strided(const std::string& op, const CudaArray& a, const std::vector<int64_t>& a_strides,
                   int64_t a_offset, const CudaArray& b, const std::vector<int64_t>& b_strides, int64_t b_offset,
                   CudaArray& out, const std::vector<int64_t>& shape) {
  check_float32("ewise_strided", {{"a", a}, {"b", b}, {"out", out}});
  const Operand ops[2] = {{"a", &a_strides, a_offset, a.size}, {"b", &b_strides, b_offset, b.size}};
  StridedView views[2];
  int64_t n = 0;
  make_views("ewise_strided", shape, ops, views, &n);
  check_out("ewise_strided", out, n, a, &b);
  with_binary_op("ewise_strided", op, [&](auto f) {
    if (n == 0) return;
    ewise_strided_kernel<<<grid_for(n), kBlockSize>>>(data<float>(a), views[0], data<float>(b), views[1],
                                                      data<float>(out), n, f);
    check_kernel("ewise_strided");
  });
}

void scalar_strided(const std::string& op, const CudaArray& a, const std::vector<int64_t>& strides, int64_t offset,
                    float val, CudaArray& out, const std::vector<int64_t>& shape) {
  check_float32("scalar_strided", {{"a", a}, {"out", out}});
  const Operand ops[1] = {{"a", &strides, offset, a.size}};
  StridedView views[1];
  int64_t n = 0;
  make_views("scalar_strided", shape, ops, views, &n);
  check_out("scalar_strided", out, n, a, nullptr);
  with_binary_op("scalar_strided", op, [&](auto f) {
    if (n == 0) return;
    scalar_strided_kernel<<<grid_for(n), kBlockSize>>>(data<float>(a), views[0], val, data<float>(out), n, f);
    check_kernel("scalar_strided");
  });
}

void unary_strided(const std::string& op, const CudaArray& a, const std::vector<int64_t>& strides, int64_t offset,
                   CudaArray& out, const std::vector<int64_t>& shape) {
  check_float32("unary_strided", {{"a", a}, {"out", out}});
  const Operand ops[1] = {{"a", &strides, offset, a.size}};
  StridedView views[1];
  int64_t n = 0;
  make_views("unary_strided", shape, ops, views, &n);
  check_out("unary_strided", out, n, a, nullptr);
  auto launch = [&](auto f) {
    if (n == 0) return;
    unary_strided_kernel<<<grid_for(n), kBlockSize>>>(data<float>(a), views[0], data<float>(out), n, f);
    check_kernel("unary_strided");
  };
  if (op == "log") return launch(LogOp());
  if (op == "exp") return launch(ExpOp());
  if (op == "tanh") return launch(TanhOp());
  throw py::value_error("needle cuda: unary_strided: unknown op '" + op + "' (expected log, exp or tanh)");
}

// ---- Host wrappers: compact arrays (floating dtypes) ------------------------------------------------------

template <typename Op>
void ewise_op(const char* name, const CudaArray& a, const CudaArray& b, CudaArray& out, Op op) {
  check_floating(name, {{"a", a}, {"b", b}, {"out", out}});
  check_size(name, "a", a.size, out.size);
  check_size(name, "b", b.size, out.size);
  const int64_t n = as_int64(out.size);
  if (n == 0) return;
  visit_floating(out.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    ewise_kernel<<<grid_for(n), kBlockSize>>>(data<T>(a), data<T>(b), data<T>(out), n, op);
  });
  check_kernel(name);
}

template <typename Op>
void scalar_op(const char* name, const CudaArray& a, float val, CudaArray& out, Op op) {
  check_floating(name, {{"a", a}, {"out", out}});
  check_size(name, "a", a.size, out.size);
  const int64_t n = as_int64(out.size);
  if (n == 0) return;
  visit_floating(out.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    scalar_kernel<<<grid_for(n), kBlockSize>>>(data<T>(a), val, data<T>(out), n, op);
  });
  check_kernel(name);
}

template <typename Op>
void unary_op(const char* name, const CudaArray& a, CudaArray& out, Op op) {
  check_floating(name, {{"a", a}, {"out", out}});
  check_size(name, "a", a.size, out.size);
  const int64_t n = as_int64(out.size);
  if (n == 0) return;
  visit_floating(out.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    unary_kernel<<<grid_for(n), kBlockSize>>>(data<T>(a), data<T>(out), n, op);
  });
  check_kernel(name);
}

}  // namespace cuda
}  // namespace needle
