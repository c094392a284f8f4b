// activations.cuh -- GELU (exact and tanh-approximated) and SiLU, and their derivatives, as element-wise
// functors for elementwise.cuh's generic kernels (every floating dtype, float32 arithmetic): ewise_gelu /
// ewise_gelu_tanh / ewise_silu (out = f(a), the unary kernel) and ewise_*_grad (out = g * f'(a), the binary one,
// a = the input, b = g).
//
// The math, the same as src/cpu/activations.h (the reference: ndarray_backend_numpy.py's activation_values and
// activation_derivative, in float64):
//   gelu(x)      = x Φ(x) = 0.5 x erfc(−x / √2);               gelu'(x)      = Φ(x) + x e^(−x²/2) / √(2π)
//   gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x σ(2u), u = √(2/π)(x + 0.044715 x³);
//                  gelu_tanh'(x) = σ(2u) + 2 x σ(2u)(1 − σ(2u)) √(2/π)(1 + 3 · 0.044715 x²)
//   silu(x)      = x / (1 + e^(−x));                             silu'(x)      = σ(x)(1 + x(1 − σ(x)))
#pragma once

#include <cuda_runtime.h>

namespace needle {
namespace cuda {

constexpr float kSqrt1_2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
constexpr float kSqrt2OverPi = 0.79788456080286536f;
constexpr float kTanhCubic = 0.044715f;

struct GeluOp {
  __device__ float operator()(float x) const { return 0.5f * x * erfcf(-x * kSqrt1_2); }  // Φ(x): no cancellation
};
// The sigmoid form x σ(2u) of 0.5 x (1 + tanh(u)): no cancellation where tanh(u) is near −1; u at x clamped to ±20
// (σ(2u) is exactly 0 or 1 there in float32), so x³ never overflows. As src/cpu/activations.h.
__device__ inline float gelu_tanh_u(float x) {
  const float c = fminf(fmaxf(x, -20.0f), 20.0f);
  return kSqrt2OverPi * (c + kTanhCubic * c * c * c);
}
struct GeluTanhOp {
  __device__ float operator()(float x) const { return x / (1.0f + expf(-2.0f * gelu_tanh_u(x))); }
};
struct SiluOp {
  __device__ float operator()(float x) const { return x / (1.0f + expf(-x)); }
};

// (x, g) -> g * f'(x)
struct GeluGradOp {
  __device__ float operator()(float x, float g) const {
    return g * (0.5f * erfcf(-x * kSqrt1_2) + x * expf(-0.5f * x * x) * kInvSqrt2Pi);
  }
};
struct GeluTanhGradOp {
  __device__ float operator()(float x, float g) const {
    const float c = fminf(fmaxf(x, -20.0f), 20.0f);
    const float s = 1.0f / (1.0f + expf(-2.0f * gelu_tanh_u(x)));
    return g * (s + 2.0f * x * s * (1.0f - s) * kSqrt2OverPi * (1.0f + 3.0f * kTanhCubic * c * c));
  }
};
struct SiluGradOp {
  __device__ float operator()(float x, float g) const {
    const float s = 1.0f / (1.0f + expf(-x));
    return g * (s * (1.0f + x * (1.0f - s)));
  }
};

}  // namespace cuda
}  // namespace needle
