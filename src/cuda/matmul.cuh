// matmul.cuh -- matrix multiplication: matmul (with operands read transposed in place) and matmul_batched share
// one register-tiled kernel; matmul_tiled is the course's simple kernel on the tiled layout.
//
// Kernels first, then the host wrappers.
#pragma once

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "array.cuh"
#include "common.cuh"
#include "dtypes.cuh"

namespace needle {
namespace cuda {

// ---- Matrix multiplication --------------------------------------------------------------------------------
//
// out (m x p) = a (m x n) @ b (n x p), all compact row-major, for each of `batch` consecutive triples of matrices
// (matmul is the batch of one; matmul_batched uses blockIdx.z for the batch index, grid-stride past the
// 65535 limit of gridDim.z).  Each block computes a 64 x 64 tile of `out`.
// It walks along n in slices of 16: the block stages a 64 x 16 slice of `a` and a 16 x 64 slice of `b` in shared
// memory (every element read from global memory once per block instead of 64 times), then each of the
// 256 threads accumulates a 4 x 4 patch of `out` in registers (register tiling: every value loaded from shared
// memory is used 4 times).  Thread (tx, ty) owns rows ty + 16*i and columns tx + 16*j of the tile: consecutive
// threads own consecutive columns, so both the shared-memory reads and the final global stores are contiguous.
// Out-of-range elements are staged as zeros, so any m, n, p work.
// a and b are of storage type TIn and widened to float as they are staged, so the tiles and the accumulators
// are float32 for every dtype; out (TOut: TIn, or float32 for 16-bit inputs) is rounded once, at the end.

constexpr int kMmTileRows = 64;                                    // rows of `out` per block
constexpr int kMmTileCols = 64;                                    // columns of `out` per block
constexpr int kMmTileDepth = 16;                                   // slice of n staged per step
constexpr int kMmThreadRows = 4;                                   // each thread: 4 x 4 outputs
constexpr int kMmThreadCols = 4;
constexpr int kMmThreadsX = kMmTileCols / kMmThreadCols;           // 16
constexpr int kMmThreadsY = kMmTileRows / kMmThreadRows;           // 16
constexpr int kMmThreads = kMmThreadsX * kMmThreadsY;              // 256
constexpr int64_t kMaxGridY = 65535;                               // hardware limit of gridDim.y
constexpr int64_t kMaxGridZ = 65535;                               // and of gridDim.z
// a_tile is stored transposed (k-major) so the inner loop reads columns of the a slice contiguously.  Its
// loads write (16 k's x 2 rows) per warp; rows padded to 64 + 2 floats put those 32 stores in 32 distinct banks.
constexpr int kMmATilePitch = kMmTileRows + 2;

// Where element (r, c) of a and of b sits: a[r * a_rs + c * a_cs] (a_rs = n, a_cs = 1 for a compact a; 1 and m
// for a given transposed, as matmul's trans_a says), and likewise b.
struct MatmulStrides {
  int64_t a_rs, a_cs, b_rs, b_cs;
  bool accumulate;  // out += a @ b
};

template <typename TIn, typename TOut>
__device__ void matmul_tile(const TIn* a, const TIn* b, TOut* out, int64_t m, int64_t n, int64_t p,
                            MatmulStrides st);

template <typename TIn, typename TOut>
__global__ void __launch_bounds__(kMmThreads)
    matmul_kernel(const TIn* a, const TIn* b, TOut* out, int64_t batch, int64_t m, int64_t n, int64_t p,
                  MatmulStrides st) {
  // Every thread of a block runs the same iterations, so the __syncthreads inside matmul_tile are reached by all.
  for (int64_t z = blockIdx.z; z < batch; z += gridDim.z) {
    matmul_tile(a + z * m * n, b + z * n * p, out + z * m * p, m, n, p, st);
  }
}

// This block's 64 x 64 tile of one product.
template <typename TIn, typename TOut>
__device__ void matmul_tile(const TIn* a, const TIn* b, TOut* out, int64_t m, int64_t n, int64_t p,
                            MatmulStrides st) {
  __shared__ float a_tile[kMmTileDepth][kMmATilePitch];
  __shared__ float b_tile[kMmTileDepth][kMmTileCols];

  const int tid = static_cast<int>(threadIdx.x);
  const int tx = tid % kMmThreadsX;
  const int ty = tid / kMmThreadsX;
  const int64_t row0 = int64_t(blockIdx.x) * kMmTileRows;  // first row of this block's tile of `out`
  const int64_t col0 = int64_t(blockIdx.y) * kMmTileCols;  // first column

  float acc[kMmThreadRows][kMmThreadCols] = {};
  for (int64_t k0 = 0; k0 < n; k0 += kMmTileDepth) {
    // Stage a[row0 : row0+64, k0 : k0+16] (consecutive threads read consecutive k: coalesced).
    for (int e = tid; e < kMmTileRows * kMmTileDepth; e += kMmThreads) {
      const int r = e / kMmTileDepth;
      const int k = e % kMmTileDepth;
      const int64_t gr = row0 + r;
      const int64_t gk = k0 + k;
      a_tile[k][r] = (gr < m && gk < n) ? to_float(a[gr * st.a_rs + gk * st.a_cs]) : 0.0f;
    }
    // Stage b[k0 : k0+16, col0 : col0+64] (consecutive threads read consecutive columns: coalesced).
    for (int e = tid; e < kMmTileDepth * kMmTileCols; e += kMmThreads) {
      const int k = e / kMmTileCols;
      const int c = e % kMmTileCols;
      const int64_t gk = k0 + k;
      const int64_t gc = col0 + c;
      b_tile[k][c] = (gk < n && gc < p) ? to_float(b[gk * st.b_rs + gc * st.b_cs]) : 0.0f;
    }
    __syncthreads();  // the slices are complete before anyone reads them

#pragma unroll
    for (int k = 0; k < kMmTileDepth; ++k) {
      float a_frag[kMmThreadRows];
      float b_frag[kMmThreadCols];
#pragma unroll
      for (int i = 0; i < kMmThreadRows; ++i) a_frag[i] = a_tile[k][ty + i * kMmThreadsY];
#pragma unroll
      for (int j = 0; j < kMmThreadCols; ++j) b_frag[j] = b_tile[k][tx + j * kMmThreadsX];
#pragma unroll
      for (int i = 0; i < kMmThreadRows; ++i) {
#pragma unroll
        for (int j = 0; j < kMmThreadCols; ++j) acc[i][j] += a_frag[i] * b_frag[j];
      }
    }
    __syncthreads();  // everyone is done reading before the next slice overwrites the tiles
  }

#pragma unroll
  for (int i = 0; i < kMmThreadRows; ++i) {
#pragma unroll
    for (int j = 0; j < kMmThreadCols; ++j) {
      const int64_t gr = row0 + ty + i * kMmThreadsY;
      const int64_t gc = col0 + tx + j * kMmThreadsX;
      if (gr < m && gc < p)
        out[gr * p + gc] = from_float<TOut>(st.accumulate ? to_float(out[gr * p + gc]) + acc[i][j] : acc[i][j]);
    }
  }
}

// The course's tiled layout: an (R, C) matrix stored as an (R/T, C/T, T, T) array, i.e. tile (ti, tj) is a
// compact T x T block at ((ti * (C/T) + tj) * T * T), and element (r, c) of a tile sits at r * T + c.
// a is (m/T, n/T, T, T), b is (n/T, p/T, T, T) and out is (m/T, p/T, T, T).  One thread per output element:
// simple rather than fast; `matmul` is the fast kernel.  float32 only.
constexpr int kTile = 8;

__global__ void matmul_tiled_kernel(const float* a, const float* b, float* out, int64_t m, int64_t n, int64_t p) {
  constexpr int64_t kTileElems = int64_t(kTile) * kTile;
  const int64_t n_tiles = n / kTile;
  const int64_t p_tiles = p / kTile;
  const int64_t total = m * p;
  for (int64_t e = first_index(); e < total; e += grid_stride()) {
    const int64_t tile = e / kTileElems;  // which tile of out: (ti, tj)
    const int64_t ti = tile / p_tiles;
    const int64_t tj = tile % p_tiles;
    const int r = static_cast<int>(e % kTileElems) / kTile;  // position inside that tile
    const int c = static_cast<int>(e % kTileElems) % kTile;
    float acc = 0.0f;
    for (int64_t kt = 0; kt < n_tiles; ++kt) {
      const float* a_tile = a + (ti * n_tiles + kt) * kTileElems;
      const float* b_tile = b + (kt * p_tiles + tj) * kTileElems;
#pragma unroll
      for (int k = 0; k < kTile; ++k) acc += a_tile[r * kTile + k] * b_tile[k * kTile + c];
    }
    out[e] = acc;
  }
}

// ---- Host wrappers ----------------------------------------------------------------------------------------

// matmul / matmul_batched: a and b of one floating dtype, and out of that dtype too, or float32 for 16-bit a
// and b (the float32 accumulator kept rather than rounded to 16 bits).
void check_matmul_dtypes(const char* fn, const CudaArray& a, const CudaArray& b, const CudaArray& out) {
  const bool inputs_ok = dtype_info(a.dtype).floating && b.dtype == a.dtype;
  const bool out_ok = out.dtype == a.dtype || out.dtype == DType::kFloat32;
  if (!inputs_ok || !out_ok) {
    throw py::type_error(std::string("needle cuda: ") + fn +
                         ": expects floating a and b of one dtype and out of that dtype or float32, got " +
                         describe_dtypes({{"a", a}, {"b", b}, {"out", out}}));
  }
}

// Launches matmul_kernel for the dtypes of a, b and out (already checked by check_matmul_dtypes).
void launch_matmul(const dim3& grid, const CudaArray& a, const CudaArray& b, CudaArray& out, int64_t batch,
                   int64_t m, int64_t n, int64_t p, bool trans_a = false, bool trans_b = false,
                   bool accumulate = false) {
  const MatmulStrides st{trans_a ? 1 : n, trans_a ? m : 1, trans_b ? 1 : p, trans_b ? n : 1, accumulate};
  visit_floating(a.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    if (out.dtype == a.dtype) {
      matmul_kernel<<<grid, kMmThreads>>>(data<T>(a), data<T>(b), data<T>(out), batch, m, n, p, st);
    } else {  // 16-bit a and b, float32 out
      matmul_kernel<<<grid, kMmThreads>>>(data<T>(a), data<T>(b), data<float>(out), batch, m, n, p, st);
    }
  });
}

// trans_a: a holds A's transpose, (n x m) row-major; trans_b: b holds B's (p x n).  The tiles read them in place.
// accumulate: out += a @ b (out's value added to the float32 sums, rounded once).
void matmul(const CudaArray& a, const CudaArray& b, CudaArray& out, size_t m, size_t n, size_t p, bool trans_a,
            bool trans_b, bool accumulate) {
  check_matmul_dtypes("matmul", a, b, out);
  check_extents("matmul", "a", a.size, m, n);
  check_extents("matmul", "b", b.size, n, p);
  check_extents("matmul", "out", out.size, m, p);
  if (m == 0 || p == 0) return;  // nothing to write (n == 0 is fine: out becomes zeros)
  const int64_t col_blocks = ceil_div(as_int64(p), kMmTileCols);
  if (col_blocks > kMaxGridY) {
    throw py::value_error("needle cuda: matmul: p = " + std::to_string(p) + " columns is too many for the grid");
  }
  // Row tiles go in grid x (limit 2^31 - 1): tall matrices are the common case.
  const dim3 grid(static_cast<unsigned>(ceil_div(as_int64(m), kMmTileRows)), static_cast<unsigned>(col_blocks));
  launch_matmul(grid, a, b, out, 1, as_int64(m), as_int64(n), as_int64(p), trans_a, trans_b, accumulate);
  check_kernel("matmul");
}

// out[i] = a[i] @ b[i] for a (batch, m, n), b (batch, n, p), out (batch, m, p): one launch, the batch in grid z.
void matmul_batched(const CudaArray& a, const CudaArray& b, CudaArray& out, size_t batch, size_t m, size_t n,
                    size_t p) {
  check_matmul_dtypes("matmul_batched", a, b, out);
  check_extents("matmul_batched", "a", a.size, batch, m, n);
  check_extents("matmul_batched", "b", b.size, batch, n, p);
  check_extents("matmul_batched", "out", out.size, batch, m, p);
  if (out.size != 0 && (out.ptr == a.ptr || out.ptr == b.ptr)) {
    throw py::value_error("needle cuda: matmul_batched: out must not be one of the inputs");
  }
  if (out.size == 0) return;
  const int64_t col_blocks = ceil_div(as_int64(p), kMmTileCols);
  if (col_blocks > kMaxGridY) {
    throw py::value_error("needle cuda: matmul_batched: p = " + std::to_string(p) +
                          " columns is too many for the grid");
  }
  const dim3 grid(static_cast<unsigned>(ceil_div(as_int64(m), kMmTileRows)), static_cast<unsigned>(col_blocks),
                  static_cast<unsigned>(std::min<int64_t>(as_int64(batch), kMaxGridZ)));
  launch_matmul(grid, a, b, out, as_int64(batch), as_int64(m), as_int64(n), as_int64(p));
  check_kernel("matmul_batched");
}

void matmul_tiled(const CudaArray& a, const CudaArray& b, CudaArray& out, size_t m, size_t n, size_t p) {
  check_float32("matmul_tiled", {{"a", a}, {"b", b}, {"out", out}});
  constexpr size_t tile = kTile;
  if (m % tile != 0 || n % tile != 0 || p % tile != 0) {
    throw py::value_error("needle cuda: matmul_tiled: m, n, p must be multiples of " + std::to_string(kTile));
  }
  check_extents("matmul_tiled", "a", a.size, m, n);
  check_extents("matmul_tiled", "b", b.size, n, p);
  check_extents("matmul_tiled", "out", out.size, m, p);
  const int64_t total = as_int64(m * p);
  if (total == 0) return;
  matmul_tiled_kernel<<<grid_for(total), kBlockSize>>>(data<float>(a), data<float>(b), data<float>(out),
                                                       as_int64(m), as_int64(n), as_int64(p));
  check_kernel("matmul_tiled");
}

}  // namespace cuda
}  // namespace needle
