// activations.h -- GELU (exact and tanh-approximated) and SiLU, and their derivatives, on compact buffers of any
// floating dtype: ewise_gelu / ewise_gelu_tanh / ewise_silu (out = f(a)) and ewise_*_grad (out = g * f'(a)).
//
// The reference is ndarray_backend_numpy.py's activation_values / activation_derivative (float64, rounded once);
// here the arithmetic is float32 with the C library's erfc / exp, so results are within a few ulp of it. ±inf
// inputs give NaN derivatives (inf · 0), as PyTorch's do.
//   gelu(x)      = x Φ(x) = 0.5 x erfc(−x / √2);   gelu'(x) = Φ(x) + x φ(x), φ(x) = e^(−x²/2) / √(2π)
//   gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x σ(2u), u = √(2/π)(x + 0.044715 x³);
//                  gelu_tanh'(x) = σ(2u) + 2 x σ(2u)(1 − σ(2u)) u',  u' = √(2/π)(1 + 3 · 0.044715 x²)
//   silu(x)      = x σ(x), σ(x) = 1 / (1 + e^(−x));  silu'(x) = σ(x)(1 + x(1 − σ(x)))
#pragma once

#include "array.h"
#include "common.h"
#include "dtypes.h"
#include "elementwise.h"  // ewise_binary: the gradients' loop
#include "threads.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace needle {
namespace cpu {

constexpr float SQRT1_2 = 0.70710678118654752f;      // 1 / √2
constexpr float INV_SQRT_2PI = 0.39894228040143268f;  // 1 / √(2π)
constexpr float SQRT_2_OVER_PI = 0.79788456080286536f;
constexpr float TANH_CUBIC = 0.044715f;

struct GeluOp {
  // Φ(x) = 0.5 erfc(−x / √2): 0.5 (1 + erf(x / √2)) would cancel below x ≈ −3 (erf near −1)
  float operator()(float x) const { return 0.5f * x * std::erfc(-x * SQRT1_2); }
  float derivative(float x) const {
    return 0.5f * std::erfc(-x * SQRT1_2) + x * std::exp(-0.5f * x * x) * INV_SQRT_2PI;
  }
};
// In the sigmoid form 0.5 (1 + tanh(u)) = σ(2u): no cancellation where tanh(u) is near −1 (x below about −3, where
// the tanh form loses every digit of the small result). u is taken at x clamped to ±20, where σ(2u) is already
// exactly 0 or 1 in float32, so x³ never overflows into inf · 0.
static inline float gelu_tanh_u(float x) {
  const float c = std::fmin(std::fmax(x, -20.0f), 20.0f);
  return SQRT_2_OVER_PI * (c + TANH_CUBIC * c * c * c);
}
struct GeluTanhOp {
  float operator()(float x) const { return x / (1.0f + std::exp(-2.0f * gelu_tanh_u(x))); }
  float derivative(float x) const {
    const float c = std::fmin(std::fmax(x, -20.0f), 20.0f);
    const float s = 1.0f / (1.0f + std::exp(-2.0f * gelu_tanh_u(x)));
    return s + 2.0f * x * s * (1.0f - s) * SQRT_2_OVER_PI * (1.0f + 3.0f * TANH_CUBIC * c * c);
  }
};
struct SiluOp {
  float operator()(float x) const { return x / (1.0f + std::exp(-x)); }
  float derivative(float x) const {
    const float s = 1.0f / (1.0f + std::exp(-x));
    return s * (1.0f + x * (1.0f - s));
  }
};

// out[i] = f(a[i]); load as float, round once on store. Every element costs a transcendental: threads from
// PARALLEL_TRANSCENDENTAL elements on.
template <class Op>
static void activation_forward(const char* fn, const Array& a, Array& out, Op f) {
  check_size(fn, "out", out.size, a.size);
  visit_float(same_float_dtype(fn, {&a, &out}), [&](auto t) {
    using T = decltype(t);
    const T* pa = a.data<T>();
    T* po = out.data<T>();
    parallel_range(a.size, threads_for(a.size, true), [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) po[i] = from_float<T>(f(to_float(pa[i])));
    });
  });
}

// out[i] = g[i] * f'(a[i]): elementwise.h's binary loop (a = the input, b = g) with this functor.
template <class F>
struct TimesDerivative {
  static constexpr bool expensive = true;
  scalar_t operator()(scalar_t x, scalar_t g) const { return g * F().derivative(x); }
};

static void ewise_gelu(const Array& a, Array& out) { activation_forward("ewise_gelu", a, out, GeluOp()); }
static void ewise_gelu_tanh(const Array& a, Array& out) { activation_forward("ewise_gelu_tanh", a, out, GeluTanhOp()); }
static void ewise_silu(const Array& a, Array& out) { activation_forward("ewise_silu", a, out, SiluOp()); }
static void ewise_gelu_grad(const Array& a, const Array& g, Array& out) {
  ewise_binary("ewise_gelu_grad", a, g, out, TimesDerivative<GeluOp>());
}
static void ewise_gelu_tanh_grad(const Array& a, const Array& g, Array& out) {
  ewise_binary("ewise_gelu_tanh_grad", a, g, out, TimesDerivative<GeluTanhOp>());
}
static void ewise_silu_grad(const Array& a, const Array& g, Array& out) {
  ewise_binary("ewise_silu_grad", a, g, out, TimesDerivative<SiluOp>());
}

}  // namespace cpu
}  // namespace needle
