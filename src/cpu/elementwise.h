// elementwise.h -- element-wise ops: ewise_* and scalar_* on compact buffers, any floating dtype (load as float,
// compute, round once on store); ewise_strided, scalar_strided and unary_strided on strided views, float32,
// where broadcast or transposed operands are read in place, never compacted first.
//
// Comparisons produce 1.0f / 0.0f; maximum propagates NaN like numpy.maximum.
#pragma once

#include "array.h"
#include "common.h"
#include "dtypes.h"
#include "threads.h"
#include "vector_math.h"
#include "walk.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace needle {
namespace cpu {

// ---- Element-wise ops on compact buffers ------------------------------------------------------------------------
// Plain loops; with -O3 GCC vectorizes the cheap ones (out may be the same buffer as an input, so there is no
// __restrict: GCC adds a runtime overlap check).

static inline scalar_t max_nan(scalar_t x, scalar_t y) { return (x > y || x != x) ? x : y; }

// The binary operations, shared by the compact (ewise_*, scalar_*) and strided (ewise_strided, scalar_strided)
// entry points.  `expensive` ones get threads from PARALLEL_TRANSCENDENTAL elements on.
struct AddOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t y) const { return x + y; }
};
struct SubOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t y) const { return x - y; }
};
struct MulOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t y) const { return x * y; }
};
struct DivOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t y) const { return x / y; }
};
struct PowerOp {
  static constexpr bool expensive = true;
  scalar_t operator()(scalar_t x, scalar_t y) const { return std::pow(x, y); }
};
struct MaximumOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t y) const { return max_nan(x, y); }
};
struct EqOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t y) const { return scalar_t(x == y); }
};
struct GeOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t y) const { return scalar_t(x >= y); }
};
struct GtOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t y) const { return scalar_t(x > y); }
};

// Written once over the storage type: load as float, compute, round on store (the identity for float32).
template <class Op>
static void ewise_binary(const char* fn, const Array& a, const Array& b, Array& out, Op f) {
  check_size(fn, "b", b.size, a.size);
  check_size(fn, "out", out.size, a.size);
  visit_float(same_float_dtype(fn, {&a, &b, &out}), [&](auto t) {
    using T = decltype(t);
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* po = out.data<T>();
    parallel_range(a.size, threads_for(a.size, Op::expensive), [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) po[i] = from_float<T>(f(to_float(pa[i]), to_float(pb[i])));
    });
  });
}

template <class Op>
static void scalar_binary(const char* fn, const Array& a, scalar_t val, Array& out, Op f) {
  check_size(fn, "out", out.size, a.size);
  visit_float(same_float_dtype(fn, {&a, &out}), [&](auto t) {
    using T = decltype(t);
    const T* pa = a.data<T>();
    T* po = out.data<T>();
    parallel_range(a.size, threads_for(a.size, Op::expensive), [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) po[i] = from_float<T>(f(to_float(pa[i]), val));
    });
  });
}

// The float32 vector kernels (exp, log, tanh) on 16-bit data: blocks of BLOCK elements are widened into a float
// buffer on the stack, mapped there and rounded back, so the kernels stay the float32 ones.
constexpr size_t BLOCK = 256;

template <class T, class K>
static void in_float_blocks(const T* in, T* out, size_t n, K kernel) {
  float buf[BLOCK];
  for (size_t b = 0; b < n; b += BLOCK) {
    const size_t len = std::min(BLOCK, n - b);
    for (size_t j = 0; j < len; ++j) buf[j] = to_float(in[b + j]);
    kernel(buf, buf, static_cast<int64_t>(len));
    for (size_t j = 0; j < len; ++j) out[b + j] = from_float<T>(buf[j]);
  }
}

static void ewise_add(const Array& a, const Array& b, Array& out) { ewise_binary("ewise_add", a, b, out, AddOp()); }
static void ewise_mul(const Array& a, const Array& b, Array& out) { ewise_binary("ewise_mul", a, b, out, MulOp()); }
static void ewise_div(const Array& a, const Array& b, Array& out) { ewise_binary("ewise_div", a, b, out, DivOp()); }
static void ewise_maximum(const Array& a, const Array& b, Array& out) {
  ewise_binary("ewise_maximum", a, b, out, MaximumOp());
}
static void ewise_eq(const Array& a, const Array& b, Array& out) { ewise_binary("ewise_eq", a, b, out, EqOp()); }
static void ewise_ge(const Array& a, const Array& b, Array& out) { ewise_binary("ewise_ge", a, b, out, GeOp()); }
static void ewise_gt(const Array& a, const Array& b, Array& out) { ewise_binary("ewise_gt", a, b, out, GtOp()); }
static void ewise_power(const Array& a, const Array& b, Array& out) {
  ewise_binary("ewise_power", a, b, out, PowerOp());
}

static void scalar_add(const Array& a, scalar_t val, Array& out) { scalar_binary("scalar_add", a, val, out, AddOp()); }
static void scalar_mul(const Array& a, scalar_t val, Array& out) { scalar_binary("scalar_mul", a, val, out, MulOp()); }
static void scalar_div(const Array& a, scalar_t val, Array& out) { scalar_binary("scalar_div", a, val, out, DivOp()); }
static void scalar_maximum(const Array& a, scalar_t val, Array& out) {
  scalar_binary("scalar_maximum", a, val, out, MaximumOp());
}
static void scalar_eq(const Array& a, scalar_t val, Array& out) { scalar_binary("scalar_eq", a, val, out, EqOp()); }
static void scalar_ge(const Array& a, scalar_t val, Array& out) { scalar_binary("scalar_ge", a, val, out, GeOp()); }
static void scalar_gt(const Array& a, scalar_t val, Array& out) { scalar_binary("scalar_gt", a, val, out, GtOp()); }

// x^2 and x^1 are common (squared errors) and need no pow call.
struct SquareOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t) const { return x * x; }
};
struct FirstOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t) const { return x; }
};
// x^0.5 (Adam's denominator, norms) is a square root, as NumPy computes it (so -0 gives -0 and -inf NaN):
// correctly rounded and vectorizable, where a vectorized pow may be an ulp off.
struct SqrtOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t) const { return std::sqrt(x); }
};
static void scalar_power(const Array& a, scalar_t val, Array& out) {
  if (val == 0.5f) {
    scalar_binary("scalar_power", a, val, out, SqrtOp());
  } else if (val == 2.0f) {
    scalar_binary("scalar_power", a, val, out, SquareOp());
  } else if (val == 1.0f) {
    scalar_binary("scalar_power", a, val, out, FirstOp());
  } else {
    scalar_binary("scalar_power", a, val, out, PowerOp());
  }
}

typedef void (*vector_fn)(const scalar_t*, scalar_t*, int64_t);

static void ewise_vector(const char* fn, const Array& a, Array& out, vector_fn kernel) {
  check_size(fn, "out", out.size, a.size);
  visit_float(same_float_dtype(fn, {&a, &out}), [&](auto t) {
    using T = decltype(t);
    const T* pa = a.data<T>();
    T* po = out.data<T>();
    parallel_range(a.size, threads_for(a.size, true), [&](size_t begin, size_t end) {
      if constexpr (std::is_same<T, float>::value) {
        kernel(pa + begin, po + begin, static_cast<int64_t>(end - begin));
      } else {
        in_float_blocks(pa + begin, po + begin, end - begin, kernel);
      }
    });
  });
}

static void ewise_log(const Array& a, Array& out) { ewise_vector("ewise_log", a, out, g_vector->log); }
static void ewise_exp(const Array& a, Array& out) { ewise_vector("ewise_exp", a, out, g_vector->exp); }
static void ewise_tanh(const Array& a, Array& out) { ewise_vector("ewise_tanh", a, out, g_vector->tanh); }

// ---- Element-wise ops on strided views --------------------------------------------------------------------------
//
// out (compact, `shape`) = op(a view, b view) without compacting either view: a Walk over the two operands
// (walk.h) hands each run to binary_run, whose inner loop is specialised for the stride pairs that occur in
// practice: (1, 1) both contiguous, (1, 0) / (0, 1) one side broadcast along the run (a row vector or a
// scalar: the Z - broadcast(lse) of a softmax), and anything else (transposed views) element by element.
// out must not share a buffer with a or b (checked), so the loops may use __restrict.

template <class Op>
static inline void binary_run(const scalar_t* __restrict a, int64_t sa, const scalar_t* __restrict b, int64_t sb,
                              scalar_t* __restrict out, int64_t n, Op f) {
  if (sa == 1 && sb == 1) {
    for (int64_t j = 0; j < n; ++j) out[j] = f(a[j], b[j]);
  } else if (sa == 1 && sb == 0) {
    const scalar_t y = *b;
    for (int64_t j = 0; j < n; ++j) out[j] = f(a[j], y);
  } else if (sa == 0 && sb == 1) {
    const scalar_t x = *a;
    for (int64_t j = 0; j < n; ++j) out[j] = f(x, b[j]);
  } else {
    for (int64_t j = 0; j < n; ++j) out[j] = f(a[j * sa], b[j * sb]);
  }
}

// Calls visit(op) with the functor of the binary operation named `name`.
template <class V>
static void with_binary_op(const char* fn, const std::string& name, V visit) {
  if (name == "add") return visit(AddOp());
  if (name == "sub") return visit(SubOp());
  if (name == "mul") return visit(MulOp());
  if (name == "div") return visit(DivOp());
  if (name == "power") return visit(PowerOp());
  if (name == "maximum") return visit(MaximumOp());
  if (name == "eq") return visit(EqOp());
  if (name == "ge") return visit(GeOp());
  if (name == "gt") return visit(GtOp());
  fail(std::string(fn) + ": unknown op '" + name + "' (expected add, sub, mul, div, power, maximum, eq, ge or gt)");
}

static void check_out(const char* fn, const Array& out, size_t size, const Array* inputs[], int count) {
  check_size(fn, "out", out.size, size);
  for (int k = 0; k < count; ++k)
    if (out.size != 0 && out.ptr == inputs[k]->ptr) fail(std::string(fn) + ": out must not be one of the inputs");
}

// out[i] = op(a[a view element i], b[b view element i]); operand 0 of the walk is a, operand 1 is b.
static void strided_binary(const char* fn, const std::string& op, const scalar_t* a, const scalar_t* b,
                           const Walk<2>& w, Array& out) {
  scalar_t* po = out.ptr;
  with_binary_op(fn, op, [&](auto f) {
    for_each_run(w, threads_for(w.size, decltype(f)::expensive),
                 [&](const int64_t* pos, size_t i, int64_t len, const int64_t* step) {
                   binary_run(a + pos[0], step[0], b + pos[1], step[1], po + i, len, f);
                 });
  });
}

static void ewise_strided(const std::string& op, const Array& a, const std::vector<int64_t>& a_strides,
                          int64_t a_offset, const Array& b, const std::vector<int64_t>& b_strides, int64_t b_offset,
                          Array& out, const std::vector<int64_t>& shape) {
  const Operand ops[2] = {{"a", &a_strides, a_offset, a.size}, {"b", &b_strides, b_offset, b.size}};
  require_float32("ewise_strided", {&a, &b, &out});
  const Walk<2> w = make_walk("ewise_strided", shape, ops);
  const Array* inputs[] = {&a, &b};
  check_out("ewise_strided", out, w.size, inputs, 2);
  strided_binary("ewise_strided", op, a.ptr, b.ptr, w, out);
}

// The scalar is operand b of the same walk: one element with stride 0 along every dimension.
static void scalar_strided(const std::string& op, const Array& a, const std::vector<int64_t>& strides,
                           int64_t offset, scalar_t val, Array& out, const std::vector<int64_t>& shape) {
  const std::vector<int64_t> zeros(shape.size(), 0);
  const Operand ops[2] = {{"a", &strides, offset, a.size}, {"val", &zeros, 0, 1}};
  require_float32("scalar_strided", {&a, &out});
  const Walk<2> w = make_walk("scalar_strided", shape, ops);
  const Array* inputs[] = {&a};
  check_out("scalar_strided", out, w.size, inputs, 1);
  strided_binary("scalar_strided", op, a.ptr, &val, w, out);
}

// out[i] = f(a[view element i]) for f in log, exp, tanh: each run is mapped straight from a when it is
// contiguous, otherwise first gathered into its place in out and mapped there.
static void unary_strided(const std::string& op, const Array& a, const std::vector<int64_t>& strides,
                          int64_t offset, Array& out, const std::vector<int64_t>& shape) {
  vector_fn kernel = op == "log" ? g_vector->log : op == "exp" ? g_vector->exp : op == "tanh" ? g_vector->tanh
                                                                                              : nullptr;
  if (kernel == nullptr) fail("unary_strided: unknown op '" + op + "' (expected log, exp or tanh)");
  require_float32("unary_strided", {&a, &out});
  const Walk<1> w = make_view("unary_strided", shape, strides, offset, a.size);
  const Array* inputs[] = {&a};
  check_out("unary_strided", out, w.size, inputs, 1);
  const scalar_t* pa = a.ptr;
  scalar_t* po = out.ptr;
  for_each_run(w, threads_for(w.size, true), [&](const int64_t* pos, size_t i, int64_t len, const int64_t* step) {
    if (step[0] == 1) {
      kernel(pa + pos[0], po + i, len);
    } else {
      for (int64_t j = 0; j < len; ++j) po[i + j] = pa[pos[0] + j * step[0]];
      kernel(po + i, po + i, len);
    }
  });
}

}  // namespace cpu
}  // namespace needle
