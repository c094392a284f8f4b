// attention.h -- fused scaled-dot-product attention (FlashAttention-2) for the C++ CPU backend:
// attention_forward, attention_backward.
//
// Built on gemm (matmul_gemm.h: the packed, register-tiled matmul, called here on one thread per tile product),
// the vectorized exp / max (g_vector, vector_math.h) and dropout's hash (lowbias32, random.h).  src/README.md
// states the contract; the NumPy reference backend writes the same algorithm as plain loops over tiles.
//
// The T_q x T_k matrix of scores never exists.  One matrix of the batch (one batch element and head) is
// q (t_q x d), k (t_k x d), v (t_k x d_v), all row-major; tiles are ATTN_BR query rows by ATTN_BC key rows.
//
//   forward, per query tile Q_i (a work item: OpenMP spreads (matrix, query tile) pairs over the threads):
//     m = -inf, l = 0, O = 0                                      running row max, row sum, unnormalized output
//     for each key tile K_j the tile's queries see:
//       S = scale * Q_i K_j^T, masked                             (gemm with K_j^T packed: d x c)
//       m' = max(m, rowmax S);  P = exp(S - m');  a = exp(m - m')
//       l = a l + rowsum P;  O = a O + (P z) V_j;  m = m'         (z: the dropout factor, else 1)
//     out_i = O / l;  lse_i = m + log l
//   backward, per matrix (a work item), key tiles outer as in FlashAttention-2:
//     delta = rowsum(dout * out) - dlse
//     for each key tile j:  dK_j = dV_j = 0
//       for each query tile i that sees it:
//         P = exp(scale * Q_i K_j^T (masked) - lse_i)
//         dV_j += (P z)^T dout_i;  dP = (dout_i V_j^T) z;  dS = P (dP - delta_i) scale
//         dQ_i += dS K_j;  dK_j += dS^T Q_i
//
// Arithmetic is float32 whatever the storage: 16-bit inputs are widened when a thread copies its matrix (or the
// part of it that it needs) into its scratch, and the results are rounded once when written.  Every element is
// computed by one thread in a fixed order, so results do not depend on the number of threads.  The scratch is
// per thread and linear in T (std::vector, outside the Array accounting, like matmul's packing buffers): about
// (t_q + 2 t_k) (d + d_v) floats plus a few tiles.
#pragma once

#include "array.h"
#include "common.h"
#include "dtypes.h"
#include "matmul_gemm.h"
#include "random.h"
#include "threads.h"
#include "vector_math.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace needle {
namespace cpu {

constexpr int64_t ATTN_BR = 64;  // query rows per tile
constexpr int64_t ATTN_BC = 64;  // key rows per tile

struct AttentionShape {
  int64_t batch, t_q, t_k, d, d_v;
  bool causal;
  // Causal: query i sees keys j <= i + shift (the last query aligned with the last key; t_q <= t_k is checked).
  int64_t shift() const { return t_k - t_q; }
  // One past the last key that query rows [i0, i1) see.
  int64_t keys_end(int64_t i1) const { return causal ? std::min(t_k, i1 + shift()) : t_k; }
  // How many of the keys [j0, j0 + c) query i sees (a prefix of them).
  int64_t visible(int64_t i, int64_t j0, int64_t c) const {
    return causal ? std::max<int64_t>(0, std::min(c, i + shift() - j0 + 1)) : c;
  }
};

// The dropout factor z of element (row, col) of the (batch * t_q) x t_k matrix of probabilities: 1 / (1 - p)
// where the hash of (seed, row * t_k + col) is >= threshold, else 0 (src/README.md gives the hash).
struct AttentionDropout {
  bool on;
  uint32_t seed, threshold;
  float scale;

  AttentionDropout(double p, uint32_t seed_)
      : on(p > 0.0), seed(seed_),
        threshold(static_cast<uint32_t>(std::min(p * 4294967296.0, 4294967295.0))),
        scale(static_cast<float>(1.0 / (1.0 - p))) {}

  // p (r x c, rows row0.., keys col0..) times z, into out (which may be p).
  void apply(const float* p, float* out, int64_t r, int64_t c, uint64_t row0, int64_t col0, int64_t t_k) const {
    for (int64_t a = 0; a < r; ++a) {
      const uint64_t base = (row0 + uint64_t(a)) * uint64_t(t_k) + uint64_t(col0);
      for (int64_t j = 0; j < c; ++j) {
        const uint64_t idx = base + uint64_t(j);
        const uint32_t key = lowbias32(uint32_t(idx >> 32) ^ (seed * 0x9E3779B9u));
        const float z = lowbias32(uint32_t(idx) ^ key) >= threshold ? scale : 0.0f;
        out[a * c + j] = p[a * c + j] * z;
      }
    }
  }
};

// n elements as float: the pointer itself for float32, else widened into buf.
template <class T>
static const float* attn_as_float(const T* src, size_t n, std::vector<float>& buf) {
  if constexpr (std::is_same<T, float>::value) {
    return src;
  } else {
    buf.resize(n);
    for (size_t i = 0; i < n; ++i) buf[i] = to_float(src[i]);
    return buf.data();
  }
}

// The key tiles [0, end) of m (rows x w, row-major) transposed tile by tile: tile j0 is the w x c matrix at
// out + j0 * w, so each is a compact right-hand operand for gemm.
template <class T>
static void attn_pack_transposed(const T* m, int64_t end, int64_t w, float* out) {
  for (int64_t j0 = 0; j0 < end; j0 += ATTN_BC) {
    const int64_t c = std::min(ATTN_BC, end - j0);
    float* tile = out + j0 * w;
    for (int64_t j = 0; j < c; ++j)
      for (int64_t e = 0; e < w; ++e) tile[e * c + j] = to_float(m[(j0 + j) * w + e]);
  }
}

// S (r x c) = scale * S, and -inf where the causal mask hides a key from query i0 + a.
static void attn_scale_and_mask(float* s, int64_t r, int64_t c, int64_t i0, int64_t j0, float scale,
                                const AttentionShape& sh) {
  for (int64_t a = 0; a < r; ++a) {
    float* row = s + a * c;
    const int64_t n = sh.visible(i0 + a, j0, c);
    for (int64_t j = 0; j < n; ++j) row[j] *= scale;
    for (int64_t j = n; j < c; ++j) row[j] = -std::numeric_limits<float>::infinity();
  }
}

static void attn_transpose(const float* a, int64_t rows, int64_t cols, float* out) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[j * rows + i] = a[i * cols + j];
}

static void attn_add(float* acc, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
}

static float attn_row_sum(const float* x, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s;
}

// ---- forward: one query tile of one matrix -----------------------------------------------------------------
struct AttnForwardScratch {
  std::vector<float> kt, s, pv, o, m, l, alpha, qf, vf;
  explicit AttnForwardScratch(const AttentionShape& sh)
      : kt(sh.d * sh.t_k), s(ATTN_BR * ATTN_BC), pv(ATTN_BR * sh.d_v), o(ATTN_BR * sh.d_v), m(ATTN_BR),
        l(ATTN_BR), alpha(ATTN_BR) {}
};

// Matrix b's query rows [i0, i0 + ATTN_BR): q, k, v, out, lse point at matrix b.
template <class T>
static void attention_forward_tile(const T* q, const T* k, const T* v, T* out, float* lse, const AttentionShape& sh,
                                   int64_t b, int64_t i0, float scale, const AttentionDropout& drop,
                                   AttnForwardScratch& w) {
  const int64_t r = std::min(ATTN_BR, sh.t_q - i0), end = sh.keys_end(i0 + r), d = sh.d, dv = sh.d_v;
  const float* qf = attn_as_float(q + i0 * d, size_t(r * d), w.qf);
  const float* vf = attn_as_float(v, size_t(end * dv), w.vf);
  attn_pack_transposed(k, end, d, w.kt.data());
  float *s = w.s.data(), *o = w.o.data(), *m = w.m.data(), *l = w.l.data(), *alpha = w.alpha.data();
  std::fill(m, m + r, -std::numeric_limits<float>::infinity());
  std::fill(l, l + r, 0.0f);
  std::fill(o, o + r * dv, 0.0f);
  for (int64_t j0 = 0; j0 < end; j0 += ATTN_BC) {
    const int64_t c = std::min(ATTN_BC, end - j0);
    gemm(qf, w.kt.data() + j0 * d, s, r, d, c, 1);  // S = Q_i K_j^T
    attn_scale_and_mask(s, r, c, i0, j0, scale, sh);
    for (int64_t a = 0; a < r; ++a) {
      float* row = s + a * c;
      const float m_new = std::max(m[a], g_vector->max(row, c));  // finite: every query sees key 0 (tile 0)
      alpha[a] = std::exp(m[a] - m_new);                          // 0 on the first tile (m = -inf)
      m[a] = m_new;
      for (int64_t j = 0; j < c; ++j) row[j] -= m_new;
    }
    g_vector->exp(s, s, r * c);  // P = exp(S - m'); a masked -inf gives 0
    for (int64_t a = 0; a < r; ++a) {
      l[a] = alpha[a] * l[a] + attn_row_sum(s + a * c, c);
      float* orow = o + a * dv;
      for (int64_t e = 0; e < dv; ++e) orow[e] *= alpha[a];
    }
    if (drop.on) drop.apply(s, s, r, c, uint64_t(b * sh.t_q + i0), j0, sh.t_k);  // (after l: l sums P, not P z)
    gemm(s, vf + j0 * dv, w.pv.data(), r, c, dv, 1);  // (P z) V_j
    attn_add(o, w.pv.data(), r * dv);
  }
  for (int64_t a = 0; a < r; ++a) {
    const float inv = 1.0f / l[a];
    for (int64_t e = 0; e < dv; ++e) out[(i0 + a) * dv + e] = from_float<T>(o[a * dv + e] * inv);
    lse[i0 + a] = m[a] + std::log(l[a]);
  }
}

// ---- backward: one matrix ----------------------------------------------------------------------------------
struct AttnBackwardScratch {
  std::vector<float> kt, vt, dq, s, dp, pd, pt, tmp, dk, dv, qf, kf, vf, of, gf;
  explicit AttnBackwardScratch(const AttentionShape& sh)
      : kt(sh.d * sh.t_k), vt(sh.d_v * sh.t_k), dq(sh.t_q * sh.d), s(ATTN_BR * ATTN_BC), dp(ATTN_BR * ATTN_BC),
        pd(ATTN_BR * ATTN_BC), pt(ATTN_BR * ATTN_BC), tmp(std::max(ATTN_BR, ATTN_BC) * std::max(sh.d, sh.d_v)),
        dk(ATTN_BC * sh.d), dv(ATTN_BC * sh.d_v) {}
};

template <class T>
static void attention_backward_one(const T* q, const T* k, const T* v, const T* out, const float* lse,
                                   const T* dout, const float* dlse, float* delta, T* dq, T* dk, T* dv,
                                   const AttentionShape& sh, int64_t b, float scale, const AttentionDropout& drop,
                                   AttnBackwardScratch& w) {
  const int64_t tq = sh.t_q, tk = sh.t_k, d = sh.d, dvw = sh.d_v;
  const float* qf = attn_as_float(q, size_t(tq * d), w.qf);
  const float* kf = attn_as_float(k, size_t(tk * d), w.kf);
  const float* of = attn_as_float(out, size_t(tq * dvw), w.of);
  const float* gf = attn_as_float(dout, size_t(tq * dvw), w.gf);
  for (int64_t i = 0; i < tq; ++i) {  // delta_i = dout_i . out_i - dlse_i
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t e = 0; e < dvw; ++e) sum += gf[i * dvw + e] * of[i * dvw + e];
    delta[i] = sum - dlse[i];
  }
  attn_pack_transposed(k, tk, d, w.kt.data());
  attn_pack_transposed(v, tk, dvw, w.vt.data());
  float *s = w.s.data(), *dp = w.dp.data(), *pt = w.pt.data(), *tmp = w.tmp.data();
  float *dq_acc = w.dq.data(), *dk_acc = w.dk.data(), *dv_acc = w.dv.data();
  std::fill(dq_acc, dq_acc + tq * d, 0.0f);
  for (int64_t j0 = 0; j0 < tk; j0 += ATTN_BC) {
    const int64_t c = std::min(ATTN_BC, tk - j0);
    std::fill(dk_acc, dk_acc + c * d, 0.0f);
    std::fill(dv_acc, dv_acc + c * dvw, 0.0f);
    const int64_t first = sh.causal ? std::max<int64_t>(0, j0 - sh.shift()) / ATTN_BR * ATTN_BR : 0;
    for (int64_t i0 = first; i0 < tq; i0 += ATTN_BR) {
      const int64_t r = std::min(ATTN_BR, tq - i0);
      gemm(qf + i0 * d, w.kt.data() + j0 * d, s, r, d, c, 1);  // S = Q_i K_j^T
      attn_scale_and_mask(s, r, c, i0, j0, scale, sh);
      for (int64_t a = 0; a < r; ++a)
        for (int64_t j = 0; j < c; ++j) s[a * c + j] -= lse[i0 + a];
      g_vector->exp(s, s, r * c);  // P
      const float* pz = s;
      if (drop.on) {
        drop.apply(s, w.pd.data(), r, c, uint64_t(b * tq + i0), j0, tk);
        pz = w.pd.data();
      }
      attn_transpose(pz, r, c, pt);
      gemm(pt, gf + i0 * dvw, tmp, c, r, dvw, 1);  // (P z)^T dout_i
      attn_add(dv_acc, tmp, c * dvw);
      gemm(gf + i0 * dvw, w.vt.data() + j0 * dvw, dp, r, dvw, c, 1);  // dP = dout_i V_j^T
      if (drop.on) drop.apply(dp, dp, r, c, uint64_t(b * tq + i0), j0, tk);
      for (int64_t a = 0; a < r; ++a) {  // dS = P (dP - delta) scale, in dp
        const float da = delta[i0 + a];
        for (int64_t j = 0; j < c; ++j) dp[a * c + j] = s[a * c + j] * (dp[a * c + j] - da) * scale;
      }
      gemm(dp, kf + j0 * d, tmp, r, c, d, 1);  // dS K_j
      attn_add(dq_acc + i0 * d, tmp, r * d);
      attn_transpose(dp, r, c, pt);
      gemm(pt, qf + i0 * d, tmp, c, r, d, 1);  // dS^T Q_i
      attn_add(dk_acc, tmp, c * d);
    }
    for (int64_t x = 0; x < c * d; ++x) dk[j0 * d + x] = from_float<T>(dk_acc[x]);
    for (int64_t x = 0; x < c * dvw; ++x) dv[j0 * dvw + x] = from_float<T>(dv_acc[x]);
  }
  for (int64_t x = 0; x < tq * d; ++x) dq[x] = from_float<T>(dq_acc[x]);
}

// ---- the contract's functions ------------------------------------------------------------------------------
static AttentionShape check_attention(const char* fn, int64_t batch, int64_t t_q, int64_t t_k, int64_t d,
                                      int64_t d_v, bool causal, double dropout_p) {
  std::ostringstream msg;
  if (batch < 0 || t_q < 1 || t_k < 1 || d < 1 || d_v < 1) {
    msg << fn << ": needs batch >= 0 and t_q, t_k, d, d_v >= 1, got batch=" << batch << ", t_q=" << t_q
        << ", t_k=" << t_k << ", d=" << d << ", d_v=" << d_v;
    fail(msg.str());
  }
  if (causal && t_q > t_k) {
    msg << fn << ": causal attention with more queries than keys (T_q=" << t_q << " > T_k=" << t_k
        << ") leaves the first " << t_q - t_k << " queries without a key to attend to; the causal mask aligns the "
        << "last query with the last key (query i sees keys j <= i + T_k - T_q), so it needs T_q <= T_k";
    fail(msg.str());
  }
  if (!(dropout_p >= 0.0 && dropout_p < 1.0)) {
    msg << fn << ": dropout_p must be in [0, 1), got " << dropout_p;
    fail(msg.str());
  }
  return {batch, t_q, t_k, d, d_v, causal};
}

static void require_row_stats(const char* fn, std::initializer_list<std::pair<const char*, const Array*>> stats,
                              size_t rows) {
  for (const auto& st : stats)
    if (st.second->dtype != DType::f32)
      throw py::type_error(std::string(fn) + ": " + st.first + " must be float32, got " + st.second->dtype_name());
  for (const auto& st : stats) check_size(fn, st.first, st.second->size, rows);
}

// Runs body(item, scratch) for item < n on up to num_threads() threads, one scratch per thread; an exception
// (a failed allocation) must not leave the OpenMP region, so it is noted and rethrown as MemoryError after.
template <class Scratch, class Body>
static void attn_parallel(int64_t n, const AttentionShape& sh, Body body) {
  const int nthreads = int(std::max<int64_t>(1, std::min<int64_t>(num_threads(), n)));
  int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    std::unique_ptr<Scratch> w;
    try {
      w.reset(new Scratch(sh));
    } catch (...) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < n; ++item) {
      if (!w) continue;
      try {
        body(item, *w);
      } catch (...) {
#pragma omp atomic write
        failed = 1;
      }
    }
  }
  if (failed) throw std::bad_alloc();
}

static void attention_forward(const Array& q, const Array& k, const Array& v, Array& out, Array& lse,
                              int64_t batch, int64_t t_q, int64_t t_k, int64_t d, int64_t d_v, double scale,
                              bool causal, double dropout_p, uint32_t seed) {
  const char* fn = "attention_forward";
  const AttentionShape sh = check_attention(fn, batch, t_q, t_k, d, d_v, causal, dropout_p);
  const DType dt = same_float_dtype(fn, {&q, &k, &v, &out});
  check_extents(fn, "q", q.size, batch, t_q, d);
  check_extents(fn, "k", k.size, batch, t_k, d);
  check_extents(fn, "v", v.size, batch, t_k, d_v);
  check_extents(fn, "out", out.size, batch, t_q, d_v);
  require_row_stats(fn, {{"lse", &lse}}, checked_product(fn, "the row statistics", batch, t_q));
  const AttentionDropout drop(dropout_p, seed);
  const int64_t tiles = (t_q + ATTN_BR - 1) / ATTN_BR;
  py::gil_scoped_release release;
  visit_float(dt, [&](auto tag) {
    using T = decltype(tag);
    const T *qp = q.data<T>(), *kp = k.data<T>(), *vp = v.data<T>();
    T* op = out.data<T>();
    float* lp = lse.data<float>();
    attn_parallel<AttnForwardScratch>(batch * tiles, sh, [&](int64_t item, AttnForwardScratch& w) {
      const int64_t b = item / tiles, i0 = item % tiles * ATTN_BR;
      attention_forward_tile(qp + b * t_q * d, kp + b * t_k * d, vp + b * t_k * d_v, op + b * t_q * d_v,
                             lp + b * t_q, sh, b, i0, float(scale), drop, w);
    });
  });
}

static void attention_backward(const Array& q, const Array& k, const Array& v, const Array& out, const Array& lse,
                               const Array& dout, const Array& dlse, Array& delta, Array& dq, Array& dk, Array& dv,
                               int64_t batch, int64_t t_q, int64_t t_k, int64_t d, int64_t d_v, double scale,
                               bool causal, double dropout_p, uint32_t seed) {
  const char* fn = "attention_backward";
  const AttentionShape sh = check_attention(fn, batch, t_q, t_k, d, d_v, causal, dropout_p);
  const DType dt = same_float_dtype(fn, {&q, &k, &v, &out, &dout, &dq, &dk, &dv});
  check_extents(fn, "q", q.size, batch, t_q, d);
  check_extents(fn, "k", k.size, batch, t_k, d);
  check_extents(fn, "v", v.size, batch, t_k, d_v);
  check_extents(fn, "out", out.size, batch, t_q, d_v);
  check_extents(fn, "dout", dout.size, batch, t_q, d_v);
  check_extents(fn, "dq", dq.size, batch, t_q, d);
  check_extents(fn, "dk", dk.size, batch, t_k, d);
  check_extents(fn, "dv", dv.size, batch, t_k, d_v);
  require_row_stats(fn, {{"lse", &lse}, {"dlse", &dlse}, {"delta", &delta}},
                    checked_product(fn, "the row statistics", batch, t_q));
  const AttentionDropout drop(dropout_p, seed);
  py::gil_scoped_release release;
  visit_float(dt, [&](auto tag) {
    using T = decltype(tag);
    attn_parallel<AttnBackwardScratch>(batch, sh, [&](int64_t b, AttnBackwardScratch& w) {
      const int64_t qo = b * t_q * d, ko = b * t_k * d, vo = b * t_k * d_v, oo = b * t_q * d_v, ro = b * t_q;
      attention_backward_one(q.data<T>() + qo, k.data<T>() + ko, v.data<T>() + vo, out.data<T>() + oo,
                             lse.data<float>() + ro, dout.data<T>() + oo, dlse.data<float>() + ro,
                             delta.data<float>() + ro, dq.data<T>() + qo, dk.data<T>() + ko, dv.data<T>() + vo, sh,
                             b, float(scale), drop, w);
    });
  });
}

}  // namespace cpu
}  // namespace needle
