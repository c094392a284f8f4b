// adam.h -- the optimizer kernels: sgd_step (SGD with momentum in one pass), adam_step (Adam's update in one pass)
// and adam8bit_step (Adam with block-wise 8-bit moments, Dettmers et al. 2021, on quantize.h's rule).
//
// They compute in float32 with every operation rounded (no fused multiply-add), so their bytes equal the NumPy
// reference's and the element-wise composite's.  Each takes the course's coupled weight decay, g + theta * wd,
// computed only when wd is not 0 (adding theta * 0 would turn -0 into +0 and spread an infinite theta's NaN).
#pragma once

#include "array.h"
#include "quantize.h"
#include "random.h"
#include "threads.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace needle {
namespace cpu {

#if defined(__GNUC__) && !defined(__clang__)
#define NEEDLE_NO_FMA __attribute__((optimize("fp-contract=off")))
#else
#define NEEDLE_NO_FMA
#endif

// The hyper-parameters as the element-wise ops see Python floats: each rounded once to float32 (1 - beta in
// double first).  c1, c2 are Adam's bias corrections 1 - beta^t.
struct AdamHyper {
  AdamHyper(double lr_, double beta1, double beta2, double eps_, double correction1, double correction2)
      : b1(static_cast<float>(beta1)), a1(static_cast<float>(1.0 - beta1)), b2(static_cast<float>(beta2)),
        a2(static_cast<float>(1.0 - beta2)), c1(static_cast<float>(correction1)),
        c2(static_cast<float>(correction2)), lr(static_cast<float>(lr_)), eps(static_cast<float>(eps_)) {}
  float b1, a1, b2, a2, c1, c2, lr, eps;
};

// sgd_step: SGD's update of one float32 parameter in one pass instead of five element-wise kernels.  Per element,
// in float32 with every operation rounded as the element-wise kernels round it:
//   g = g + theta * wd                                     (only when wd != 0)
//   u = u * beta + g * (1 - beta)   (first step: u = g * (1 - beta); without momentum, beta = 0: u = g, u not kept)
//   out = theta - u * lr
NEEDLE_NO_FMA static void sgd_step(const Array& theta, const Array& grad, const Array& u, Array& out, Array& out_u,
                                   bool first, double lr, double momentum, double weight_decay) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const char* fn = "sgd_step";
  const size_t n = theta.size;
  check_blockwise(fn, {{"theta", theta, DType::f32, n},
                       {"grad", grad, DType::f32, n},
                       {"u", u, DType::f32, n},
                       {"out", out, DType::f32, n},
                       {"out_u", out_u, DType::f32, n}});
  const float beta = static_cast<float>(momentum), a = static_cast<float>(1.0 - momentum);
  const float step = static_cast<float>(lr), wd = static_cast<float>(weight_decay);
  const bool decay = weight_decay != 0.0, keep = momentum != 0.0;
  const float *pt = theta.data<float>(), *pg = grad.data<float>(), *pu = u.data<float>();
  float *po = out.data<float>(), *ou = out_u.data<float>();
  const int nthreads = threads_for(n, true);
  py::gil_scoped_release release;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t i = 0; i < static_cast<int64_t>(n); ++i) {  // loop-invariant branches only: vectorized
    const float t = pt[i], g = decay ? pg[i] + t * wd : pg[i];
    const float uk = !keep ? g : first ? g * a : pu[i] * beta + g * a;
    po[i] = t - uk * step;
    if (keep) ou[i] = uk;
  }
}

// A new parameter value stored as T: float32 as it is; bfloat16 to nearest (key 0 and not stochastic) or, with
// stochastic rounding, round_stochastic's bits for flat index i.
template <class T>
static inline T store_param(float x, bool stochastic, uint32_t key, uint64_t i) {
  if constexpr (std::is_same<T, float>::value) {
    return x;
  } else {
    return stochastic ? stochastic_bf16(x, key, i) : from_float<T>(x);
  }
}

// adam_step: Adam's update of one parameter in one pass instead of eleven element-wise kernels (each a Python call
// and a full-size temporary).  Per element, in float32 with every operation rounded as the element-wise kernels
// round it (so the bytes equal the composite update's):
//   m = m * b1 + g * (1 - b1);  v = v * b2 + (g * g) * (1 - b2)
//   (first step: m = g * (1 - b1), v = (g * g) * (1 - b2))
//   out = theta - (m / c1) * lr / (sqrt(v / c2) + eps)
// where g = grad + theta * wd (wd != 0) or grad.  theta, m, v and the outputs are float32; or theta bfloat16 (a pure
// bfloat16 parameter), updated in place, each value widened and its new value rounded back -- theta to nearest
// (seed < 0) or stochastically with round_stochastic's bits for (seed, index), its state (bfloat16 or float32) to
// nearest; grad float32 or of theta's dtype.
template <class T, class G, class S>
NEEDLE_NO_FMA static void adam_loop(const T* pt, const G* pg, const S* pm, const S* pv, T* po, S* om, S* ov, size_t n,
                                    bool first, const AdamHyper& h, float wd, bool decay, int64_t seed) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const float b1 = h.b1, a1 = h.a1, b2 = h.b2, a2 = h.a2, c1 = h.c1, c2 = h.c2, step = h.lr, fe = h.eps;
  const bool stochastic = seed >= 0;
  const uint32_t key = static_cast<uint32_t>(seed) * 0x9E3779B9u;
  const int nthreads = threads_for(n, true);
  py::gil_scoped_release release;
  // An OpenMP loop, not parallel_range's lambda: the region's body keeps this function's fp-contract=off.
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t i = 0; i < static_cast<int64_t>(n); ++i) {  // no branches but loop-invariant ones: vectorized
    const float t = to_float(pt[i]), g = decay ? to_float(pg[i]) + t * wd : to_float(pg[i]);
    const float mk = first ? g * a1 : to_float(pm[i]) * b1 + g * a1;
    const float vk = first ? (g * g) * a2 : to_float(pv[i]) * b2 + (g * g) * a2;
    po[i] = store_param<T>(t - mk / c1 * step / (std::sqrt(vk / c2) + fe), stochastic, key, static_cast<uint64_t>(i));
    om[i] = store_param<S>(mk, false, 0, 0);
    ov[i] = store_param<S>(vk, false, 0, 0);
  }
}

static void adam_step(const Array& theta, const Array& grad, const Array& m, const Array& v, Array& out, Array& out_m,
                      Array& out_v, bool first, double lr, double beta1, double beta2, double eps, double correction1,
                      double correction2, double weight_decay, int64_t seed) {
  const char* fn = "adam_step";
  const size_t n = theta.size;
  const bool bf16 = theta.dtype == DType::bf16;
  const DType dt = bf16 ? DType::bf16 : DType::f32, grad_dtype = grad.dtype == DType::bf16 ? dt : DType::f32;
  const DType state = out_m.dtype == DType::bf16 ? dt : DType::f32;  // a bfloat16 parameter's: either
  // (on the first step m and v are not read: the caller passes grad in their place)
  const DType state_in = first && m.dtype == grad.dtype ? m.dtype : state;
  check_blockwise(fn, {{"theta", theta, dt, n},
                       {"grad", grad, grad_dtype, n},
                       {"m", m, state_in, n},
                       {"v", v, state_in, n},
                       {"out", out, dt, n},
                       {"out_m", out_m, state, n},
                       {"out_v", out_v, state, n}});
  if (bf16 && out.ptr != theta.ptr) fail(std::string(fn) + ": a bfloat16 theta is updated in place: out must be theta");
  if (!bf16 && seed >= 0) fail(std::string(fn) + ": stochastic rounding (seed >= 0) needs a bfloat16 theta");
  const AdamHyper h(lr, beta1, beta2, eps, correction1, correction2);
  const float wd = static_cast<float>(weight_decay);
  const bool decay = weight_decay != 0.0;
  if (!bf16) {
    adam_loop(theta.data<float>(), grad.data<float>(), m.data<float>(), v.data<float>(), out.data<float>(),
              out_m.data<float>(), out_v.data<float>(), n, first, h, wd, decay, seed);
    return;
  }
  auto run = [&](auto grad_type, auto state_type) {
    using G = decltype(grad_type);
    using S = decltype(state_type);
    const S *pm = first ? nullptr : m.data<S>(), *pv = first ? nullptr : v.data<S>();
    adam_loop(theta.data<bfloat16_t>(), grad.data<G>(), pm, pv, out.data<bfloat16_t>(), out_m.data<S>(),
              out_v.data<S>(), n, first, h, wd, decay, seed);
  };
  if (grad_dtype == DType::bf16) {
    state == DType::bf16 ? run(bfloat16_t(), bfloat16_t()) : run(bfloat16_t(), float());
  } else {
    state == DType::bf16 ? run(float(), bfloat16_t()) : run(float(), float());
  }
}

// ---- 8-bit Adam, fused (Dettmers et al. 2021) ------------------------------------------------------------
//
// adam8bit_step: one Adam update of a parameter whose moments are stored block-wise in 8 bits, in one pass per
// block instead of dequantize -> nine element-wise kernels -> quantize.  Per element i of block b, in float32
// with every operation rounded (no fused multiply-add, so the bytes equal the NumPy reference's):
//   m = code_m[q_m[i]] * absmax_m[b];  r = code_v[q_v[i]] * absmax_v[b];  v = r * r      (q_v stores sqrt(v))
//   g = grad[i] + theta[i] * wd  (wd != 0; else g = grad[i])
//   m = m * b1 + g * (1 - b1);  v = v * b2 + (g * g) * (1 - b2)
//   out[i] = theta[i] - (m / c1) * lr / (sqrt(v / c2) + eps)
// then the block's new m and sqrt(v) are quantized into q_m, absmax_m, q_v, absmax_v (quantize_blockwise's rule).
// A thread keeps one block's new m and sqrt(v) in a buffer between the absmax and the quantizing loop.
// x[k] /= absmax (0 when absmax is 0), as quantize_blockwise divides: a loop without branches, so it vectorizes.
static void scale_block(float* x, size_t n, float absmax) {
  if (absmax == 0.0f) {
    std::fill(x, x + n, 0.0f);
  } else {
    for (size_t k = 0; k < n; ++k) x[k] /= absmax;
  }
}

// The blocks of adam8bit_step for theta and out of storage type T (float32, or bfloat16 updated in place: each
// value widened, updated in float32, rounded back) and grad of G.
template <class T, class G>
NEEDLE_NO_FMA static void adam8bit_blocks(const T* pt, const G* pg, uint8_t* qm, float* am, uint8_t* qv, float* av,
                                          const float* cm, const float* cv, T* po, size_t n, size_t bs,
                                          const AdamHyper& h, float wd, bool decay, int64_t seed) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const float b1 = h.b1, a1 = h.a1, b2 = h.b2, a2 = h.a2, c1 = h.c1, c2 = h.c2, step = h.lr, fe = h.eps;
  const size_t blocks = n == 0 ? 0 : (n - 1) / bs + 1;
  const bool stochastic = seed >= 0;
  const uint32_t key = static_cast<uint32_t>(seed) * 0x9E3779B9u;
  const int nthreads = threads_for(n, true);
  const CodeBuckets &buckets_m = buckets_for(cm), &buckets_v = buckets_for(cv);
  py::gil_scoped_release release;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    std::vector<float> m(std::min(bs, n)), r(std::min(bs, n));  // one block's new m and sqrt(v)
#pragma omp for schedule(static)
    for (int64_t b = 0; b < static_cast<int64_t>(blocks); ++b) {
      const size_t begin = static_cast<size_t>(b) * bs, len = std::min(n, begin + bs) - begin;
      const float old_m = am[b], old_r = av[b];
      for (size_t k = 0; k < len; ++k) {  // dequantize (table lookups: scalar)
        m[k] = cm[qm[begin + k]] * old_m;
        r[k] = cv[qv[begin + k]] * old_r;
      }
      const G* g = pg + begin;
      const T* t = pt + begin;
      T* o = po + begin;
      for (size_t k = 0; k < len; ++k) {  // Adam (no lookups, loop-invariant branches only: vectorized)
        const float tk = to_float(t[k]), gk = decay ? to_float(g[k]) + tk * wd : to_float(g[k]);
        const float mk = m[k] * b1 + gk * a1;
        const float vk = r[k] * r[k] * b2 + gk * gk * a2;
        o[k] = store_param<T>(tk - mk / c1 * step / (std::sqrt(vk / c2) + fe), stochastic, key, begin + k);
        m[k] = mk;
        r[k] = std::sqrt(vk);
      }
      const float new_m = block_absmax(m.data(), len), new_r = block_absmax(r.data(), len);
      am[b] = new_m;
      av[b] = new_r;
      scale_block(m.data(), len, new_m);  // x = value / absmax, then the nearest code (lookups)
      scale_block(r.data(), len, new_r);
      for (size_t k = 0; k < len; ++k) {
        qm[begin + k] = buckets_m.nearest(cm, m[k]);
        qv[begin + k] = buckets_v.nearest(cv, r[k]);
      }
    }
  }
}

// theta and out float32; or a bfloat16 theta updated in place (out is theta), its gradient bfloat16 or float32,
// each new value rounded to nearest (seed < 0) or stochastically with round_stochastic's bits for (seed, index).
static void adam8bit_step(const Array& theta, const Array& grad, Array& q_m, Array& absmax_m, Array& q_v,
                          Array& absmax_v, const Array& code_m, const Array& code_v, Array& out, int64_t block_size,
                          double lr, double beta1, double beta2, double eps, double correction1, double correction2,
                          double weight_decay, int64_t seed) {
  const char* fn = "adam8bit_step";
  const size_t n = theta.size, blocks = num_blocks(fn, n, block_size);
  const bool bf16 = theta.dtype == DType::bf16;
  const DType grad_dtype = bf16 && grad.dtype == DType::bf16 ? DType::bf16 : DType::f32;
  check_blockwise(fn, {{"theta", theta, bf16 ? DType::bf16 : DType::f32, n},
                       {"grad", grad, grad_dtype, n},
                       {"q_m", q_m, DType::u8, n},
                       {"absmax_m", absmax_m, DType::f32, blocks},
                       {"q_v", q_v, DType::u8, n},
                       {"absmax_v", absmax_v, DType::f32, blocks},
                       {"code_m", code_m, DType::f32, CODE_SIZE},
                       {"code_v", code_v, DType::f32, CODE_SIZE},
                       {"out", out, theta.dtype, n}});
  if (bf16 && out.ptr != theta.ptr) fail(std::string(fn) + ": a bfloat16 theta is updated in place: out must be theta");
  if (!bf16 && seed >= 0) fail(std::string(fn) + ": stochastic rounding (seed >= 0) needs a bfloat16 theta");
  const AdamHyper h(lr, beta1, beta2, eps, correction1, correction2);
  const float wd = static_cast<float>(weight_decay);
  const bool decay = weight_decay != 0.0;
  const size_t bs = static_cast<size_t>(block_size);
  uint8_t *qm = q_m.data<uint8_t>(), *qv = q_v.data<uint8_t>();
  float *am = absmax_m.data<float>(), *av = absmax_v.data<float>();
  const float *cm = code_m.data<float>(), *cv = code_v.data<float>();
  if (!bf16) {
    adam8bit_blocks(theta.data<float>(), grad.data<float>(), qm, am, qv, av, cm, cv, out.data<float>(), n, bs, h,
                    wd, decay, seed);
  } else if (grad_dtype == DType::bf16) {
    adam8bit_blocks(theta.data<bfloat16_t>(), grad.data<bfloat16_t>(), qm, am, qv, av, cm, cv,
                    out.data<bfloat16_t>(), n, bs, h, wd, decay, seed);
  } else {
    adam8bit_blocks(theta.data<bfloat16_t>(), grad.data<float>(), qm, am, qv, av, cm, cv, out.data<bfloat16_t>(),
                    n, bs, h, wd, decay, seed);
  }
}

}  // namespace cpu
}  // namespace needle
