// adam.h -- the optimizer kernels: sgd_step (SGD with momentum in one pass), adam_step (Adam's update in one pass)
// and adam8bit_step (Adam with block-wise 8-bit moments, Dettmers et al. 2021, on quantize.h's rule).
//
// They compute in float32 with every operation rounded (no fused multiply-add), so their bytes equal the NumPy
// reference's and the element-wise composite's.  Each takes the course's coupled weight decay, g + theta * wd,
// computed only when wd is not 0 (adding theta * 0 would turn -0 into +0 and spread an infinite theta's NaN).
#pragma once

#include "array.h"
#include "quantize.h"
#include "threads.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
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

// adam_step: Adam's update of one float32 parameter in one pass instead of eleven element-wise kernels (each a
// Python call and a full-size temporary).  Per element, in float32 with every operation rounded as the element-wise
// kernels round it (so the bytes equal the composite update's):
//   m = m * b1 + g * (1 - b1);  v = v * b2 + (g * g) * (1 - b2)
//   (first step: m = g * (1 - b1), v = (g * g) * (1 - b2))
//   out = theta - (m / c1) * lr / (sqrt(v / c2) + eps)
// where g = grad + theta * wd (wd != 0) or grad.
NEEDLE_NO_FMA static void adam_step(const Array& theta, const Array& grad, const Array& m, const Array& v, Array& out,
                                    Array& out_m, Array& out_v, bool first, double lr, double beta1, double beta2,
                                    double eps, double correction1, double correction2, double weight_decay) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const char* fn = "adam_step";
  const size_t n = theta.size;
  check_blockwise(fn, {{"theta", theta, DType::f32, n},
                       {"grad", grad, DType::f32, n},
                       {"m", m, DType::f32, n},
                       {"v", v, DType::f32, n},
                       {"out", out, DType::f32, n},
                       {"out_m", out_m, DType::f32, n},
                       {"out_v", out_v, DType::f32, n}});
  const AdamHyper h(lr, beta1, beta2, eps, correction1, correction2);
  const float b1 = h.b1, a1 = h.a1, b2 = h.b2, a2 = h.a2, c1 = h.c1, c2 = h.c2, step = h.lr, fe = h.eps;
  const float wd = static_cast<float>(weight_decay);
  const bool decay = weight_decay != 0.0;
  const float *pt = theta.data<float>(), *pg = grad.data<float>(), *pm = m.data<float>(), *pv = v.data<float>();
  float *po = out.data<float>(), *om = out_m.data<float>(), *ov = out_v.data<float>();
  const int nthreads = threads_for(n, true);
  py::gil_scoped_release release;
  // An OpenMP loop, not parallel_range's lambda: the region's body keeps this function's fp-contract=off.
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t i = 0; i < static_cast<int64_t>(n); ++i) {  // no branches but loop-invariant ones: vectorized
    const float g = decay ? pg[i] + pt[i] * wd : pg[i];
    const float mk = first ? g * a1 : pm[i] * b1 + g * a1;
    const float vk = first ? (g * g) * a2 : pv[i] * b2 + (g * g) * a2;
    po[i] = pt[i] - mk / c1 * step / (std::sqrt(vk / c2) + fe);
    om[i] = mk;
    ov[i] = vk;
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

NEEDLE_NO_FMA static void adam8bit_step(const Array& theta, const Array& grad, Array& q_m, Array& absmax_m,
                                        Array& q_v, Array& absmax_v, const Array& code_m, const Array& code_v,
                                        Array& out, int64_t block_size, double lr, double beta1, double beta2,
                                        double eps, double correction1, double correction2,
                                        double weight_decay) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const char* fn = "adam8bit_step";
  const size_t n = theta.size, blocks = num_blocks(fn, n, block_size);
  check_blockwise(fn, {{"theta", theta, DType::f32, n},
                       {"grad", grad, DType::f32, n},
                       {"q_m", q_m, DType::u8, n},
                       {"absmax_m", absmax_m, DType::f32, blocks},
                       {"q_v", q_v, DType::u8, n},
                       {"absmax_v", absmax_v, DType::f32, blocks},
                       {"code_m", code_m, DType::f32, CODE_SIZE},
                       {"code_v", code_v, DType::f32, CODE_SIZE},
                       {"out", out, DType::f32, n}});
  const AdamHyper h(lr, beta1, beta2, eps, correction1, correction2);
  const float b1 = h.b1, a1 = h.a1, b2 = h.b2, a2 = h.a2, c1 = h.c1, c2 = h.c2, step = h.lr, fe = h.eps;
  const float* pt = theta.data<float>();
  const float* pg = grad.data<float>();
  const float* cm = code_m.data<float>();
  const float* cv = code_v.data<float>();
  uint8_t* qm = q_m.data<uint8_t>();
  uint8_t* qv = q_v.data<uint8_t>();
  float* am = absmax_m.data<float>();
  float* av = absmax_v.data<float>();
  float* po = out.data<float>();
  const size_t bs = static_cast<size_t>(block_size);
  const float wd = static_cast<float>(weight_decay);
  const bool decay = weight_decay != 0.0;
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
      const float* g = pg + begin;
      const float* t = pt + begin;
      float* o = po + begin;
      for (size_t k = 0; k < len; ++k) {  // Adam (no lookups, loop-invariant branches only: vectorized)
        const float gk = decay ? g[k] + t[k] * wd : g[k];
        const float mk = m[k] * b1 + gk * a1;
        const float vk = r[k] * r[k] * b2 + gk * gk * a2;
        o[k] = t[k] - mk / c1 * step / (std::sqrt(vk / c2) + fe);
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

}  // namespace cpu
}  // namespace needle
