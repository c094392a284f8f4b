// optimizer.cuh -- fused optimizer steps: sgd_step (SGD with momentum in one pass), adam_step (Adam's update of one
// float32 parameter in one pass) and adam8bit_step (8-bit Adam: moments stored block-wise in 8 bits, Dettmers et
// al. 2021).  Every operation is an IEEE round-to-nearest intrinsic, so the bytes are the NumPy reference's.  Each
// takes the course's coupled weight decay, g = grad + theta * wd, computed only when wd is not 0.
//
// Kernels first, then the host wrappers.
#pragma once

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "array.cuh"
#include "common.cuh"
#include "quantize.cuh"
#include "random.cuh"
#include "reduce.cuh"

namespace needle {
namespace cuda {

// ---- Adam, fused -----------------------------------------------------------------------------------------

// The hyper-parameters as the element-wise ops see Python floats: each rounded once to float32 (1 - beta in double
// first).
struct AdamHyper {
  float b1, a1, b2, a2, c1, c2, lr, eps;  // beta1, 1 - beta1, beta2, 1 - beta2, 1 - beta1^t, 1 - beta2^t, lr, eps
};

AdamHyper adam_hyper(double lr, double beta1, double beta2, double eps, double correction1, double correction2) {
  return {static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
          static_cast<float>(1.0 - beta2), static_cast<float>(correction1), static_cast<float>(correction2),
          static_cast<float>(lr), static_cast<float>(eps)};
}

// g + theta * wd, the coupled weight decay (decay false: g as it is, so -0 stays -0).
__device__ float decayed(float g, float theta, bool decay, float wd) {
  return decay ? __fadd_rn(g, __fmul_rn(theta, wd)) : g;
}

// sgd_step (src/README.md): SGD's update of one float32 parameter, one thread per element (grid-stride):
// u = u * beta + g * (1 - beta) (first: g * (1 - beta); keep false, no momentum: u = g, not stored), theta - u * lr.
struct SgdHyper {
  float beta, a, lr, wd;
  bool decay, keep;
};

__global__ void sgd_step_kernel(const float* theta, const float* grad, const float* u, float* out, float* out_u,
                                int64_t n, bool first, SgdHyper h) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const float t = theta[i], g = decayed(grad[i], t, h.decay, h.wd);
    const float uk = !h.keep ? g : first ? __fmul_rn(g, h.a) : __fadd_rn(__fmul_rn(u[i], h.beta), __fmul_rn(g, h.a));
    out[i] = __fsub_rn(t, __fmul_rn(uk, h.lr));
    if (h.keep) out_u[i] = uk;
  }
}

// A new parameter value stored as T: float32 as it is; bfloat16 to nearest, or (stochastic) with round_stochastic's
// bits for flat index i.
template <typename T>
__device__ T store_param(float x, int64_t i, bool stochastic, uint32_t seed_hash) {
  if constexpr (std::is_same<T, float>::value) {
    return x;
  } else {
    return stochastic ? round_stochastic_element(x, i, seed_hash) : from_float<T>(x);
  }
}

// adam_step (src/README.md): Adam's update of one parameter, one thread per element (grid-stride), every
// operation rounded as the element-wise kernels round it (no fused multiply-add).  T: float32, or bfloat16 for a pure
// bfloat16 parameter updated in place (theta to nearest or stochastically, its state, S: bfloat16 or float32, to
// nearest); G: T or float32.
template <typename T, typename G, typename S>
__global__ void adam_step_kernel(const T* theta, const G* grad, const S* m, const S* v, T* out, S* out_m, S* out_v,
                                 int64_t n, bool first, AdamHyper h, bool decay, float wd, bool stochastic,
                                 uint32_t seed_hash) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const float t = to_float(theta[i]);
    const float g = decayed(to_float(grad[i]), t, decay, wd), gg = __fmul_rn(g, g);
    const float mk = first ? __fmul_rn(g, h.a1) : __fadd_rn(__fmul_rn(to_float(m[i]), h.b1), __fmul_rn(g, h.a1));
    const float vk = first ? __fmul_rn(gg, h.a2) : __fadd_rn(__fmul_rn(to_float(v[i]), h.b2), __fmul_rn(gg, h.a2));
    const float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(vk, h.c2)), h.eps);
    out[i] = store_param<T>(__fsub_rn(t, __fdiv_rn(__fmul_rn(__fdiv_rn(mk, h.c1), h.lr), denom)), i, stochastic,
                            seed_hash);
    out_m[i] = store_param<S>(mk, i, false, 0);
    out_v[i] = store_param<S>(vk, i, false, 0);
  }
}

// ---- 8-bit Adam, fused (Dettmers et al. 2021) ----------------------------------------------------------------
//
// adam8bit_step (src/README.md): per element, m and v = r * r are dequantized (q_v stores r = sqrt(v)), updated as
// Adam does, theta updated, and the block's new m and r quantized.  One thread block per quantization block
// (grid-stride), each thread owning the same elements throughout, in two passes:
//   1. compute the new m and r, and the block's new absmax of m and of r (block_reduce);
//   2. compute m and r again from the still unchanged bytes and theta (cheaper than holding a block of any size in
//      shared memory), write their new bytes and the new theta (last: out may be theta, which the weight decay
//      reads in both passes).
// Every operation is an IEEE round-to-nearest intrinsic (no contraction into FMA), so the bytes are the NumPy
// reference's.
__device__ void adam8bit_moments(const AdamHyper& h, float m, float r, float g, float* m_out, float* v_out) {
  *m_out = __fadd_rn(__fmul_rn(m, h.b1), __fmul_rn(g, h.a1));
  *v_out = __fadd_rn(__fmul_rn(__fmul_rn(r, r), h.b2), __fmul_rn(__fmul_rn(g, g), h.a2));
}

// theta and out of T (float32, or a bfloat16 theta updated in place), grad of G.
template <typename T, typename G>
__global__ void adam8bit_step_kernel(const T* theta, const G* grad, uint8_t* q_m, float* absmax_m,
                                     uint8_t* q_v, float* absmax_v, const float* code_m, const float* code_v,
                                     T* out, int64_t n, int64_t block_size, int64_t num_blocks, AdamHyper h,
                                     bool decay, float wd, bool stochastic, uint32_t seed_hash) {
  __shared__ float table_m[kCodeSize], table_v[kCodeSize];
  for (int j = threadIdx.x; j < kCodeSize; j += blockDim.x) {
    table_m[j] = code_m[j];
    table_v[j] = code_v[j];
  }
  __syncthreads();
  for (int64_t b = blockIdx.x; b < num_blocks; b += gridDim.x) {
    const int64_t begin = b * block_size;
    const int64_t end = n - begin < block_size ? n : begin + block_size;
    const float old_m = absmax_m[b], old_r = absmax_v[b];
    float new_m = 0.0f, new_r = 0.0f;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {  // pass 1
      float m, v;
      adam8bit_moments(h, __fmul_rn(table_m[q_m[i]], old_m), __fmul_rn(table_v[q_v[i]], old_r),
                       decayed(to_float(grad[i]), to_float(theta[i]), decay, wd), &m, &v);
      new_m = MaximumOp()(new_m, fabsf(m));
      new_r = MaximumOp()(new_r, __fsqrt_rn(v));
    }
    new_m = block_reduce(new_m, MaxReduce());  // every thread has read old_m, old_r before thread 0 writes
    new_r = block_reduce(new_r, MaxReduce());
    if (threadIdx.x == 0) {
      absmax_m[b] = new_m;
      absmax_v[b] = new_r;
    }
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {  // pass 2
      float m, v;
      const float t = to_float(theta[i]);
      adam8bit_moments(h, __fmul_rn(table_m[q_m[i]], old_m), __fmul_rn(table_v[q_v[i]], old_r),
                       decayed(to_float(grad[i]), t, decay, wd), &m, &v);
      const float r = __fsqrt_rn(v), denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(v, h.c2)), h.eps);
      out[i] = store_param<T>(__fsub_rn(t, __fdiv_rn(__fmul_rn(__fdiv_rn(m, h.c1), h.lr), denom)), i, stochastic,
                              seed_hash);
      q_m[i] = nearest_code(table_m, new_m == 0.0f ? 0.0f : __fdiv_rn(m, new_m));
      q_v[i] = nearest_code(table_v, new_r == 0.0f ? 0.0f : __fdiv_rn(r, new_r));
    }
  }
}

// ---- Host wrappers ----------------------------------------------------------------------------------------

void sgd_step(const CudaArray& theta, const CudaArray& grad, const CudaArray& u, CudaArray& out, CudaArray& out_u,
              bool first, double lr, double momentum, double weight_decay) {
  const char* fn = "sgd_step";
  check_exact_dtypes(fn, {{"theta", theta, DType::kFloat32},
                          {"grad", grad, DType::kFloat32},
                          {"u", u, DType::kFloat32},
                          {"out", out, DType::kFloat32},
                          {"out_u", out_u, DType::kFloat32}});
  for (const auto& [name, size] : {std::pair<const char*, size_t>{"grad", grad.size}, {"u", u.size},
                                   {"out", out.size}, {"out_u", out_u.size}})
    check_size(fn, name, size, theta.size);
  const int64_t n = as_int64(theta.size);
  if (n == 0) return;
  const SgdHyper h{static_cast<float>(momentum), static_cast<float>(1.0 - momentum), static_cast<float>(lr),
                   static_cast<float>(weight_decay), weight_decay != 0.0, momentum != 0.0};
  sgd_step_kernel<<<grid_for(n), kBlockSize>>>(data<float>(theta), data<float>(grad), data<float>(u),
                                               data<float>(out), data<float>(out_u), n, first, h);
  check_kernel(fn);
}

void adam_step(const CudaArray& theta, const CudaArray& grad, const CudaArray& m, const CudaArray& v, CudaArray& out,
               CudaArray& out_m, CudaArray& out_v, bool first, double lr, double beta1, double beta2, double eps,
               double correction1, double correction2, double weight_decay, int64_t seed) {
  const char* fn = "adam_step";
  const bool bf16 = theta.dtype == DType::kBFloat16;
  const DType dt = bf16 ? DType::kBFloat16 : DType::kFloat32;
  const DType grad_dtype = grad.dtype == DType::kBFloat16 ? dt : DType::kFloat32;
  const DType state = out_m.dtype == DType::kBFloat16 ? dt : DType::kFloat32;  // a bfloat16 parameter's: either
  const DType state_in = first && m.dtype == grad.dtype ? m.dtype : state;  // first: grad stands in for m and v
  check_exact_dtypes(fn, {{"theta", theta, dt},
                          {"grad", grad, grad_dtype},
                          {"m", m, state_in},
                          {"v", v, state_in},
                          {"out", out, dt},
                          {"out_m", out_m, state},
                          {"out_v", out_v, state}});
  if (bf16 && out.ptr != theta.ptr)
    throw py::value_error(std::string("needle cuda: ") + fn + ": a bfloat16 theta is updated in place: out must be theta");
  if (!bf16 && seed >= 0)
    throw py::value_error(std::string("needle cuda: ") + fn + ": stochastic rounding (seed >= 0) needs a bfloat16 theta");
  for (const auto& [name, size] : {std::pair<const char*, size_t>{"grad", grad.size}, {"m", m.size}, {"v", v.size},
                                   {"out", out.size}, {"out_m", out_m.size}, {"out_v", out_v.size}})
    check_size(fn, name, size, theta.size);
  const int64_t n = as_int64(theta.size);
  if (n == 0) return;
  const AdamHyper h = adam_hyper(lr, beta1, beta2, eps, correction1, correction2);
  const uint32_t seed_hash = static_cast<uint32_t>(seed) * 0x9E3779B9u;
  auto launch = [&](auto theta_type, auto grad_type, auto state_type) {
    using T = decltype(theta_type);
    using G = decltype(grad_type);
    using S = decltype(state_type);
    adam_step_kernel<T, G, S><<<grid_for(n), kBlockSize>>>(
        data<T>(theta), data<G>(grad), data<S>(m), data<S>(v), data<T>(out), data<S>(out_m), data<S>(out_v), n,
        first, h, weight_decay != 0.0, static_cast<float>(weight_decay), seed >= 0, seed_hash);
  };
  using B = __nv_bfloat16;
  if (!bf16) {
    launch(float(), float(), float());
  } else if (grad_dtype == DType::kBFloat16) {
    state == DType::kBFloat16 ? launch(B(), B(), B()) : launch(B(), B(), float());
  } else {
    state == DType::kBFloat16 ? launch(B(), float(), B()) : launch(B(), float(), float());
  }
  check_kernel(fn);
}

void adam8bit_step(const CudaArray& theta, const CudaArray& grad, CudaArray& q_m, CudaArray& absmax_m, CudaArray& q_v,
                   CudaArray& absmax_v, const CudaArray& code_m, const CudaArray& code_v, CudaArray& out,
                   int64_t block_size, double lr, double beta1, double beta2, double eps, double correction1,
                   double correction2, double weight_decay, int64_t seed) {
  // theta and out float32; or a bfloat16 theta updated in place (out is theta), its gradient bfloat16 or float32,
  // each new value rounded to nearest (seed < 0) or stochastically with round_stochastic's bits for (seed, index).
  const char* fn = "adam8bit_step";
  const int64_t blocks = num_quantization_blocks(fn, theta.size, block_size);
  const bool bf16 = theta.dtype == DType::kBFloat16;
  const DType grad_dtype = bf16 && grad.dtype == DType::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
  check_exact_dtypes(fn, {{"theta", theta, bf16 ? DType::kBFloat16 : DType::kFloat32},
                          {"grad", grad, grad_dtype},
                          {"q_m", q_m, DType::kUInt8},
                          {"absmax_m", absmax_m, DType::kFloat32},
                          {"q_v", q_v, DType::kUInt8},
                          {"absmax_v", absmax_v, DType::kFloat32},
                          {"code_m", code_m, DType::kFloat32},
                          {"code_v", code_v, DType::kFloat32},
                          {"out", out, theta.dtype}});
  if (bf16 && out.ptr != theta.ptr)
    throw py::value_error(std::string("needle cuda: ") + fn + ": a bfloat16 theta is updated in place: out must be theta");
  if (!bf16 && seed >= 0)
    throw py::value_error(std::string("needle cuda: ") + fn + ": stochastic rounding (seed >= 0) needs a bfloat16 theta");
  check_size(fn, "grad", grad.size, theta.size);
  check_size(fn, "q_m", q_m.size, theta.size);
  check_size(fn, "q_v", q_v.size, theta.size);
  check_size(fn, "out", out.size, theta.size);
  check_size(fn, "absmax_m", absmax_m.size, static_cast<size_t>(blocks));
  check_size(fn, "absmax_v", absmax_v.size, static_cast<size_t>(blocks));
  check_size(fn, "code_m", code_m.size, kCodeSize);
  check_size(fn, "code_v", code_v.size, kCodeSize);
  if (blocks == 0) return;
  const AdamHyper h = adam_hyper(lr, beta1, beta2, eps, correction1, correction2);
  const unsigned grid = static_cast<unsigned>(std::min(blocks, kReduceMaxBlocks));
  const unsigned threads = reduce_threads(static_cast<size_t>(block_size));
  const bool stochastic = seed >= 0;
  const uint32_t seed_hash = static_cast<uint32_t>(seed) * 0x9E3779B9u;
  const float wd = static_cast<float>(weight_decay);
  auto launch = [&](auto theta_type, auto grad_type) {
    using T = decltype(theta_type);
    using G = decltype(grad_type);
    adam8bit_step_kernel<T, G><<<grid, threads>>>(
        data<T>(theta), data<G>(grad), data<uint8_t>(q_m), data<float>(absmax_m), data<uint8_t>(q_v),
        data<float>(absmax_v), data<float>(code_m), data<float>(code_v), data<T>(out), as_int64(theta.size),
        block_size, blocks, h, weight_decay != 0.0, wd, stochastic, seed_hash);
  };
  if (!bf16) {
    launch(float(), float());
  } else if (grad_dtype == DType::kBFloat16) {
    launch(__nv_bfloat16(), __nv_bfloat16());
  } else {
    launch(__nv_bfloat16(), float());
  }
  check_kernel(fn);
}

}  // namespace cuda
}  // namespace needle
