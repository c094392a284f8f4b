// attention.cuh -- fused scaled-dot-product attention (FlashAttention-2) for the CUDA backend.
//
// src/README.md states the contract (attention_forward, attention_backward); the NumPy reference backend writes
// the same algorithm as plain loops over tiles, and is the oracle of the tests.
//
// One matrix of the batch (one batch element and head) is q (t_q x d), k (t_k x d), v (t_k x d_v), row-major;
// matrix b starts at b * t_q * d in q, and so on.  A block of kAttnThreads threads (8 warps) works on tiles held
// in shared memory as float32 (16-bit inputs are widened when loaded, results rounded once when stored):
//
//   attention_forward_kernel   block = (matrix b, query tile of kAttnRows rows); for each key tile of
//                              kAttnCols keys the query tile sees: load K_j, V_j; each warp takes its rows, one
//                              key per lane: s = scale q.k, online softmax (running max m and sum l per row, in
//                              registers, the same in every lane), O = a O + (P z) V_j in shared memory.  Writes
//                              out = O / l and lse = m + log l.
//   attention_delta_kernel     one warp per query row: delta = dout . out - dlse (FlashAttention-2's
//                              preprocessing).
//   attention_dkdv_kernel      block = (b, key tile): loops over the query tiles that see it (kAttnBwdRows rows
//                              each), recomputes P = exp(s - lse), dP = dout v^T, dS = P (dP z - delta) scale,
//                              and accumulates dV_j += (P z)^T dout, dK_j += dS^T Q in shared memory.
//   attention_dq_kernel        block = (b, query tile): loops over the key tiles it sees, recomputes dS the same
//                              way and accumulates dQ_i += dS K_j.
//
// FlashAttention-2 computes dQ in the dK/dV loop with atomic adds; here dS is recomputed in a second kernel
// instead (two more tile products), so that every output element is summed by one thread in a fixed order:
// results are deterministic, which checkpointing's bit-identical recomputation needs.  Blocks are indexed by one
// flat blockIdx.x (matrix * tiles + tile), so the batch is not limited to gridDim.y's 65535.
//
// Shared memory: rows of K (and of V where a lane reads a row) are padded to an odd stride, so the 32 lanes
// reading 32 different rows at one column hit 32 different banks.  At d = d_v = 64 every kernel needs under 48 KiB;
// larger head sizes ask for more (cudaFuncAttributeMaxDynamicSharedMemorySize), up to what the GPU offers, and
// beyond that raise ValueError naming d and d_v.
#pragma once

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>

#include "array.cuh"
#include "common.cuh"
#include "dtypes.cuh"
#include "random.cuh"

namespace needle {
namespace cuda {

constexpr int kAttnWarps = 8;
constexpr int kAttnThreads = kAttnWarps * kWarpSize;
constexpr int kAttnRows = 32;     // query rows per tile in the forward and dQ kernels (4 per warp)
constexpr int kAttnBwdRows = 16;  // query rows per step of the dK/dV kernel (2 per warp)
constexpr int kAttnCols = 32;     // keys per tile: one per lane

__host__ __device__ constexpr int64_t attn_min(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ constexpr int64_t attn_max(int64_t a, int64_t b) { return a < b ? b : a; }

// The arguments every attention kernel reads.
struct AttnParams {
  int64_t t_q, t_k;
  int d, d_v;
  float scale;
  bool causal;
  bool dropout;
  uint32_t seed_hash, threshold;  // seed_hash = uint32(seed * 0x9E3779B9)
  float dropout_scale;            // float32(1 / (1 - p))

  // Causal: query i sees keys j <= i + t_k - t_q (the last query aligned with the last key).
  __device__ bool visible(int64_t i, int64_t j) const { return !causal || j <= i + (t_k - t_q); }
  // One past the last key that query rows up to i1 (exclusive) see.
  __device__ int64_t keys_end(int64_t i1) const { return causal ? attn_min(t_k, i1 + (t_k - t_q)) : t_k; }
  // The dropout factor of element (b * t_q + i, j) of the probabilities: 1 / (1 - p) if its hash >= threshold.
  __device__ float z(int64_t b, int64_t i, int64_t j) const {
    if (!dropout) return 1.0f;
    const uint64_t idx = (uint64_t(b) * uint64_t(t_q) + uint64_t(i)) * uint64_t(t_k) + uint64_t(j);
    const uint32_t key = lowbias32(uint32_t(idx >> 32) ^ seed_hash);
    return lowbias32(uint32_t(idx) ^ key) >= threshold ? dropout_scale : 0.0f;
  }
};

__device__ inline float attn_warp_max(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFullWarpMask, x, offset));
  return x;
}

__device__ inline float attn_warp_sum(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullWarpMask, x, offset);
  return x;
}

// Rows [r0, r0 + n) of m (rows of w elements) into dst as float, `stride` apart; rows n..cap-1 are zeros.
template <typename T>
__device__ void attn_load(const T* m, int64_t r0, int n, int w, float* dst, int stride, int cap) {
  for (int x = threadIdx.x; x < cap * w; x += blockDim.x) {
    const int r = x / w, c = x % w;
    dst[r * stride + c] = r < n ? to_float(m[(r0 + r) * w + c]) : 0.0f;
  }
}

__device__ inline float attn_dot(const float* a, const float* b, int n) {
  float s = 0.0f;
  for (int x = 0; x < n; ++x) s += a[x] * b[x];
  return s;
}

// Shared-memory floats of each kernel (the kernels carve their arrays in this order).
__host__ __device__ inline size_t attn_forward_floats(int d, int d_v) {
  return size_t(kAttnRows) * d + size_t(kAttnCols) * (d | 1) + size_t(kAttnCols) * d_v + size_t(kAttnRows) * d_v +
         size_t(kAttnRows) * kAttnCols;
}
__host__ __device__ inline size_t attn_dkdv_floats(int d, int d_v) {
  return size_t(kAttnCols) * ((d | 1) + (d_v | 1) + d + d_v) + size_t(kAttnBwdRows) * (d + d_v + 2 * kAttnCols + 2);
}
__host__ __device__ inline size_t attn_dq_floats(int d, int d_v) {
  return size_t(kAttnRows) * (2 * d + d_v + kAttnCols + 2) + size_t(kAttnCols) * ((d | 1) + (d_v | 1));
}

template <typename T>
__global__ void __launch_bounds__(kAttnThreads)
    attention_forward_kernel(const T* q, const T* k, const T* v, T* out, float* lse, AttnParams p, int64_t tiles) {
  extern __shared__ float smem[];
  const int D = p.d, DV = p.d_v, ks = D | 1;
  float* sq = smem;                    // kAttnRows x D
  float* sk = sq + kAttnRows * D;      // kAttnCols x ks
  float* sv = sk + kAttnCols * ks;     // kAttnCols x DV
  float* so = sv + kAttnCols * DV;     // kAttnRows x DV: the unnormalized output
  float* sp = so + kAttnRows * DV;     // kAttnRows x kAttnCols: P z of the current tile
  const int64_t b = blockIdx.x / tiles, i0 = (blockIdx.x % tiles) * kAttnRows;
  const int rows = int(attn_min(int64_t(kAttnRows), p.t_q - i0));
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  q += b * p.t_q * D;
  k += b * p.t_k * D;
  v += b * p.t_k * DV;
  attn_load(q, i0, rows, D, sq, D, kAttnRows);
  for (int x = threadIdx.x; x < kAttnRows * DV; x += blockDim.x) so[x] = 0.0f;
  float m[kAttnRows / kAttnWarps], l[kAttnRows / kAttnWarps];
  for (int r = 0; r < kAttnRows / kAttnWarps; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  const int64_t end = p.keys_end(i0 + rows);
  for (int64_t j0 = 0; j0 < end; j0 += kAttnCols) {
    const int cols = int(attn_min(int64_t(kAttnCols), end - j0));
    __syncthreads();  // every warp is done with the previous tile (and Q, O are initialized)
    attn_load(k, j0, cols, D, sk, ks, kAttnCols);
    attn_load(v, j0, cols, DV, sv, DV, kAttnCols);
    __syncthreads();
    for (int r = 0; r < kAttnRows / kAttnWarps; ++r) {
      const int a = warp + r * kAttnWarps;  // the same in every lane: the warp stays converged
      if (a >= rows) break;
      const int64_t i = i0 + a, j = j0 + lane;
      const bool seen = lane < cols && p.visible(i, j);
      const float s = seen ? attn_dot(sq + a * D, sk + lane * ks, D) * p.scale : -INFINITY;
      const float m_new = fmaxf(m[r], attn_warp_max(s));  // finite: every query sees key 0, in the first tile
      const float pr = seen ? expf(s - m_new) : 0.0f;
      const float alpha = expf(m[r] - m_new);  // 0 on the first tile (m = -inf)
      l[r] = alpha * l[r] + attn_warp_sum(pr);  // l sums P, not P z
      m[r] = m_new;
      sp[a * kAttnCols + lane] = pr * p.z(b, i, j);
      __syncwarp();
      for (int e = lane; e < DV; e += kWarpSize) {
        float acc = so[a * DV + e] * alpha;
        for (int jj = 0; jj < cols; ++jj) acc += sp[a * kAttnCols + jj] * sv[jj * DV + e];
        so[a * DV + e] = acc;
      }
      __syncwarp();
    }
  }
  for (int r = 0; r < kAttnRows / kAttnWarps; ++r) {
    const int a = warp + r * kAttnWarps;
    if (a >= rows) break;
    const int64_t i = b * p.t_q + i0 + a;
    for (int e = lane; e < DV; e += kWarpSize) out[i * DV + e] = from_float<T>(so[a * DV + e] / l[r]);
    if (lane == 0) lse[i] = m[r] + logf(l[r]);
  }
}

// delta[row] = dout[row] . out[row] - dlse[row]: one warp per row, warps striding over the rows.
template <typename T>
__global__ void attention_delta_kernel(const T* out, const T* dout, const float* dlse, float* delta, int64_t rows,
                                       int d_v) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t first = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int64_t step = int64_t(gridDim.x) * blockDim.x / kWarpSize;
  for (int64_t row = first; row < rows; row += step) {  // the same rows in every lane of a warp
    float s = 0.0f;
    for (int e = lane; e < d_v; e += kWarpSize) s += to_float(dout[row * d_v + e]) * to_float(out[row * d_v + e]);
    s = attn_warp_sum(s);
    if (lane == 0) delta[row] = s - dlse[row];
  }
}

template <typename T>
__global__ void __launch_bounds__(kAttnThreads)
    attention_dkdv_kernel(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,
                          T* dk, T* dv, AttnParams p, int64_t tiles) {
  extern __shared__ float smem[];
  const int D = p.d, DV = p.d_v, ks = D | 1, vs = DV | 1;
  float* sk = smem;                          // kAttnCols x ks
  float* sv = sk + kAttnCols * ks;           // kAttnCols x vs
  float* sdk = sv + kAttnCols * vs;          // kAttnCols x D: dK_j
  float* sdv = sdk + kAttnCols * D;          // kAttnCols x DV: dV_j
  float* sq = sdv + kAttnCols * DV;          // kAttnBwdRows x D
  float* sdo = sq + kAttnBwdRows * D;        // kAttnBwdRows x DV
  float* spz = sdo + kAttnBwdRows * DV;      // kAttnBwdRows x kAttnCols: P z
  float* sds = spz + kAttnBwdRows * kAttnCols;  // kAttnBwdRows x kAttnCols: dS
  float* slse = sds + kAttnBwdRows * kAttnCols;  // kAttnBwdRows
  float* sdelta = slse + kAttnBwdRows;           // kAttnBwdRows
  const int64_t b = blockIdx.x / tiles, j0 = (blockIdx.x % tiles) * kAttnCols;
  const int cols = int(attn_min(int64_t(kAttnCols), p.t_k - j0));
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  q += b * p.t_q * D;
  dout += b * p.t_q * DV;
  lse += b * p.t_q;
  delta += b * p.t_q;
  attn_load(k + b * p.t_k * D, j0, cols, D, sk, ks, kAttnCols);
  attn_load(v + b * p.t_k * DV, j0, cols, DV, sv, vs, kAttnCols);
  for (int x = threadIdx.x; x < kAttnCols * D; x += blockDim.x) sdk[x] = 0.0f;
  for (int x = threadIdx.x; x < kAttnCols * DV; x += blockDim.x) sdv[x] = 0.0f;
  // The first query row that sees key j0 is j0 - (t_k - t_q); the steps start at multiples of kAttnBwdRows.
  const int64_t first = p.causal ? attn_max(int64_t(0), j0 - (p.t_k - p.t_q)) / kAttnBwdRows * kAttnBwdRows : 0;
  for (int64_t i0 = first; i0 < p.t_q; i0 += kAttnBwdRows) {
    const int rows = int(attn_min(int64_t(kAttnBwdRows), p.t_q - i0));
    __syncthreads();  // the previous step's Q, dout, P z, dS are no longer read
    attn_load(q, i0, rows, D, sq, D, kAttnBwdRows);
    attn_load(dout, i0, rows, DV, sdo, DV, kAttnBwdRows);
    for (int a = threadIdx.x; a < kAttnBwdRows; a += blockDim.x) {
      slse[a] = a < rows ? lse[i0 + a] : 0.0f;
      sdelta[a] = a < rows ? delta[i0 + a] : 0.0f;
    }
    __syncthreads();
    for (int a = warp; a < kAttnBwdRows; a += kAttnWarps) {  // one row per warp at a time, one key per lane
      const int64_t i = i0 + a, j = j0 + lane;
      float pz = 0.0f, ds = 0.0f;
      if (a < rows && lane < cols && p.visible(i, j)) {
        const float pr = expf(attn_dot(sq + a * D, sk + lane * ks, D) * p.scale - slse[a]);
        const float z = p.z(b, i, j);
        pz = pr * z;
        ds = pr * (attn_dot(sdo + a * DV, sv + lane * vs, DV) * z - sdelta[a]) * p.scale;
      }
      spz[a * kAttnCols + lane] = pz;
      sds[a * kAttnCols + lane] = ds;
    }
    __syncthreads();
    for (int jj = warp; jj < cols; jj += kAttnWarps) {  // one key per warp, the columns over the lanes
      for (int e = lane; e < DV; e += kWarpSize) {
        float acc = 0.0f;
        for (int a = 0; a < rows; ++a) acc += spz[a * kAttnCols + jj] * sdo[a * DV + e];
        sdv[jj * DV + e] += acc;
      }
      for (int c = lane; c < D; c += kWarpSize) {
        float acc = 0.0f;
        for (int a = 0; a < rows; ++a) acc += sds[a * kAttnCols + jj] * sq[a * D + c];
        sdk[jj * D + c] += acc;
      }
    }
  }
  __syncthreads();
  dk += b * p.t_k * D;
  dv += b * p.t_k * DV;
  for (int x = threadIdx.x; x < cols * D; x += blockDim.x) dk[j0 * D + x] = from_float<T>(sdk[x]);
  for (int x = threadIdx.x; x < cols * DV; x += blockDim.x) dv[j0 * DV + x] = from_float<T>(sdv[x]);
}

template <typename T>
__global__ void __launch_bounds__(kAttnThreads)
    attention_dq_kernel(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,
                        T* dq, AttnParams p, int64_t tiles) {
  extern __shared__ float smem[];
  const int D = p.d, DV = p.d_v, ks = D | 1, vs = DV | 1;
  float* sq = smem;                           // kAttnRows x D
  float* sdq = sq + kAttnRows * D;            // kAttnRows x D: dQ_i
  float* sdo = sdq + kAttnRows * D;           // kAttnRows x DV
  float* sds = sdo + kAttnRows * DV;          // kAttnRows x kAttnCols: dS
  float* slse = sds + kAttnRows * kAttnCols;  // kAttnRows
  float* sdelta = slse + kAttnRows;           // kAttnRows
  float* sk = sdelta + kAttnRows;             // kAttnCols x ks
  float* sv = sk + kAttnCols * ks;            // kAttnCols x vs
  const int64_t b = blockIdx.x / tiles, i0 = (blockIdx.x % tiles) * kAttnRows;
  const int rows = int(attn_min(int64_t(kAttnRows), p.t_q - i0));
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  k += b * p.t_k * D;
  v += b * p.t_k * DV;
  attn_load(q + b * p.t_q * D, i0, rows, D, sq, D, kAttnRows);
  attn_load(dout + b * p.t_q * DV, i0, rows, DV, sdo, DV, kAttnRows);
  for (int x = threadIdx.x; x < kAttnRows * D; x += blockDim.x) sdq[x] = 0.0f;
  for (int a = threadIdx.x; a < kAttnRows; a += blockDim.x) {
    slse[a] = a < rows ? lse[b * p.t_q + i0 + a] : 0.0f;
    sdelta[a] = a < rows ? delta[b * p.t_q + i0 + a] : 0.0f;
  }
  const int64_t end = p.keys_end(i0 + rows);
  for (int64_t j0 = 0; j0 < end; j0 += kAttnCols) {
    const int cols = int(attn_min(int64_t(kAttnCols), end - j0));
    __syncthreads();  // every warp is done with the previous K_j, V_j (and Q, dout, dQ are initialized)
    attn_load(k, j0, cols, D, sk, ks, kAttnCols);
    attn_load(v, j0, cols, DV, sv, vs, kAttnCols);
    __syncthreads();
    for (int r = 0; r < kAttnRows / kAttnWarps; ++r) {
      const int a = warp + r * kAttnWarps;
      if (a >= rows) break;
      const int64_t i = i0 + a, j = j0 + lane;
      float ds = 0.0f;
      if (lane < cols && p.visible(i, j)) {
        const float pr = expf(attn_dot(sq + a * D, sk + lane * ks, D) * p.scale - slse[a]);
        ds = pr * (attn_dot(sdo + a * DV, sv + lane * vs, DV) * p.z(b, i, j) - sdelta[a]) * p.scale;
      }
      sds[a * kAttnCols + lane] = ds;
      __syncwarp();
      for (int c = lane; c < D; c += kWarpSize) {
        float acc = 0.0f;
        for (int jj = 0; jj < cols; ++jj) acc += sds[a * kAttnCols + jj] * sk[jj * ks + c];
        sdq[a * D + c] += acc;
      }
      __syncwarp();
    }
  }
  for (int r = 0; r < kAttnRows / kAttnWarps; ++r) {
    const int a = warp + r * kAttnWarps;
    if (a >= rows) break;
    for (int c = lane; c < D; c += kWarpSize) dq[(b * p.t_q + i0 + a) * D + c] = from_float<T>(sdq[a * D + c]);
  }
}

// ---- host side ---------------------------------------------------------------------------------------------

AttnParams check_attention(const char* fn, int64_t batch, int64_t t_q, int64_t t_k, int64_t d, int64_t d_v,
                           double scale, bool causal, double dropout_p, uint32_t seed) {
  std::ostringstream msg;
  msg << "needle cuda: " << fn << ": ";
  if (batch < 0 || t_q < 1 || t_k < 1 || d < 1 || d_v < 1 || d > (1 << 20) || d_v > (1 << 20)) {
    msg << "needs batch >= 0 and t_q, t_k, d, d_v >= 1, got batch=" << batch << ", t_q=" << t_q << ", t_k=" << t_k
        << ", d=" << d << ", d_v=" << d_v;
    throw py::value_error(msg.str());
  }
  if (causal && t_q > t_k) {
    msg << "causal attention with more queries than keys (T_q=" << t_q << " > T_k=" << t_k << ") leaves the first "
        << t_q - t_k << " queries without a key to attend to; the causal mask aligns the last query with the last "
        << "key (query i sees keys j <= i + T_k - T_q), so it needs T_q <= T_k";
    throw py::value_error(msg.str());
  }
  if (!(dropout_p >= 0.0 && dropout_p < 1.0)) {
    msg << "dropout_p must be in [0, 1), got " << dropout_p;
    throw py::value_error(msg.str());
  }
  AttnParams p;
  p.t_q = t_q;
  p.t_k = t_k;
  p.d = int(d);
  p.d_v = int(d_v);
  p.scale = float(scale);
  p.causal = causal;
  p.dropout = dropout_p > 0.0;
  p.seed_hash = seed * 0x9E3779B9u;
  p.threshold = static_cast<uint32_t>(std::min(dropout_p * 4294967296.0, 4294967295.0));
  p.dropout_scale = static_cast<float>(1.0 / (1.0 - dropout_p));
  return p;
}

void check_row_stats(const char* fn, std::initializer_list<Arg> stats, size_t rows) {
  for (const Arg& arg : stats) {
    if (arg.array.dtype != DType::kFloat32) {
      throw py::type_error(std::string("needle cuda: ") + fn + ": " + arg.name + " must be float32, got " +
                           dtype_name(arg.array.dtype));
    }
    check_size(fn, arg.name, arg.array.size, rows);
  }
}

// Lets `kernel` use `floats` floats of dynamic shared memory (beyond the default 48 KiB where the GPU allows it).
template <typename Kernel>
void attn_shared_memory(const char* fn, Kernel kernel, size_t floats, int d, int d_v) {
  const size_t bytes = floats * sizeof(float);
  if (bytes <= 48 * 1024) return;
  int device = 0, optin = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute");
  if (bytes > size_t(optin)) {
    std::ostringstream msg;
    msg << "needle cuda: " << fn << ": head sizes d=" << d << ", d_v=" << d_v << " need " << bytes
        << " bytes of shared memory per block; this GPU offers " << optin;
    throw py::value_error(msg.str());
  }
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
             "cudaFuncSetAttribute");
}

void attention_forward(const CudaArray& q, const CudaArray& k, const CudaArray& v, CudaArray& out, CudaArray& lse,
                       int64_t batch, int64_t t_q, int64_t t_k, int64_t d, int64_t d_v, double scale, bool causal,
                       double dropout_p, uint32_t seed) {
  const char* fn = "attention_forward";
  const AttnParams p = check_attention(fn, batch, t_q, t_k, d, d_v, scale, causal, dropout_p, seed);
  check_floating(fn, {{"q", q}, {"k", k}, {"v", v}, {"out", out}});
  check_extents(fn, "q", q.size, batch, t_q, d);
  check_extents(fn, "k", k.size, batch, t_k, d);
  check_extents(fn, "v", v.size, batch, t_k, d_v);
  check_extents(fn, "out", out.size, batch, t_q, d_v);
  check_row_stats(fn, {{"lse", lse}}, checked_product(fn, "the row statistics", batch, t_q));
  if (batch == 0) return;
  const int64_t tiles = ceil_div(t_q, kAttnRows);
  const size_t floats = attn_forward_floats(p.d, p.d_v);
  visit_floating(q.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    attn_shared_memory(fn, attention_forward_kernel<T>, floats, p.d, p.d_v);
    attention_forward_kernel<T><<<dim3(unsigned(batch * tiles)), kAttnThreads, floats * sizeof(float)>>>(
        data<T>(q), data<T>(k), data<T>(v), data<T>(out), data<float>(lse), p, tiles);
  });
  check_kernel("attention_forward_kernel");
}

void attention_backward(const CudaArray& q, const CudaArray& k, const CudaArray& v, const CudaArray& out,
                        const CudaArray& lse, const CudaArray& dout, const CudaArray& dlse, CudaArray& delta,
                        CudaArray& dq, CudaArray& dk, CudaArray& dv, int64_t batch, int64_t t_q, int64_t t_k,
                        int64_t d, int64_t d_v, double scale, bool causal, double dropout_p, uint32_t seed) {
  const char* fn = "attention_backward";
  const AttnParams p = check_attention(fn, batch, t_q, t_k, d, d_v, scale, causal, dropout_p, seed);
  check_floating(fn, {{"q", q}, {"k", k}, {"v", v}, {"out", out}, {"dout", dout}, {"dq", dq}, {"dk", dk},
                      {"dv", dv}});
  check_extents(fn, "q", q.size, batch, t_q, d);
  check_extents(fn, "k", k.size, batch, t_k, d);
  check_extents(fn, "v", v.size, batch, t_k, d_v);
  check_extents(fn, "out", out.size, batch, t_q, d_v);
  check_extents(fn, "dout", dout.size, batch, t_q, d_v);
  check_extents(fn, "dq", dq.size, batch, t_q, d);
  check_extents(fn, "dk", dk.size, batch, t_k, d);
  check_extents(fn, "dv", dv.size, batch, t_k, d_v);
  check_row_stats(fn, {{"lse", lse}, {"dlse", dlse}, {"delta", delta}},
                  checked_product(fn, "the row statistics", batch, t_q));
  if (batch == 0) return;
  const int64_t q_tiles = ceil_div(t_q, kAttnRows), k_tiles = ceil_div(t_k, kAttnCols);
  const size_t dkdv_floats = attn_dkdv_floats(p.d, p.d_v), dq_floats = attn_dq_floats(p.d, p.d_v);
  visit_floating(q.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    const int64_t rows = batch * t_q;
    attention_delta_kernel<T><<<dim3(unsigned(std::min(ceil_div(rows, kAttnWarps), int64_t(65535)))),
                                kAttnThreads>>>(data<T>(out), data<T>(dout), data<float>(dlse), data<float>(delta),
                                                rows, p.d_v);
    check_kernel("attention_delta_kernel");
    attn_shared_memory(fn, attention_dkdv_kernel<T>, dkdv_floats, p.d, p.d_v);
    attention_dkdv_kernel<T><<<dim3(unsigned(batch * k_tiles)), kAttnThreads, dkdv_floats * sizeof(float)>>>(
        data<T>(q), data<T>(k), data<T>(v), data<T>(dout), data<float>(lse), data<float>(delta), data<T>(dk),
        data<T>(dv), p, k_tiles);
    check_kernel("attention_dkdv_kernel");
    attn_shared_memory(fn, attention_dq_kernel<T>, dq_floats, p.d, p.d_v);
    attention_dq_kernel<T><<<dim3(unsigned(batch * q_tiles)), kAttnThreads, dq_floats * sizeof(float)>>>(
        data<T>(q), data<T>(k), data<T>(v), data<T>(dout), data<float>(lse), data<float>(delta), data<T>(dq), p,
        q_tiles);
    check_kernel("attention_dq_kernel");
  });
}

}  // namespace cuda
}  // namespace needle
