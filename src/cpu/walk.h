// walk.h -- walking strided views: Walk, make_walk / make_view (check every view against its buffer and
// simplify it) and for_each_run (visit it run by run, on threads, tiled where an operand is transposed).  The
// copies of views.h and the strided element-wise ops of elementwise.h are written on it.
//
// Every function that reads or writes strided views walks them the same way, through a Walk: N views (one per
// operand) of one common shape, visited in row-major order of that shape.  Element i of the shape (its
// row-major index, which is also its index in any compact operand such as `out`) has the multi-index
// idx = (idx_0, ..., idx_{d-1}), and operand k reads it at buffer position
//     offset_k + sum_j idx_j * strides_k[j].
//
// Simplification (make_walk) changes neither which elements are visited nor their order: dimensions of extent
// 1 are dropped, and neighbouring dimensions j, j+1 are merged into one when *every* operand has
// strides[j] == strides[j+1] * shape[j+1] (the pair then moves through memory like a single dimension).  Two
// contiguous operands thus become one dimension of stride 1, while a transposed or broadcast operand keeps the
// dimensions it needs.  The innermost dimension is then walked in "runs" (for_each_run): a run is a stretch
// along it, where each operand moves by a constant stride (1: contiguous, 0: broadcast), the shape inner loops
// are fast on.
#pragma once

#include "common.h"
#include "threads.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace needle {
namespace cpu {

template <int N>
struct Walk {
  std::vector<int64_t> shape;       // simplified; at least one dimension when size > 0
  std::vector<int64_t> strides[N];  // strides[k][j]: operand k's stride along dimension j
  int64_t offset[N] = {};
  size_t size = 0;  // number of elements
};

// One operand of a Walk before simplification: its strides and offset, and the buffer they must stay inside.
struct Operand {
  const char* what;
  const std::vector<int64_t>* strides;
  int64_t offset;
  size_t buffer_size;
};

// Raises ValueError unless op has one stride per dimension and every element of the view (shape, op) lies
// inside op's buffer.
static void check_view(const char* fn, const std::vector<int64_t>& shape, size_t size, const Operand& op) {
  if (op.strides->size() != shape.size()) {
    std::ostringstream msg;
    msg << fn << ": " << op.what << " has " << op.strides->size() << " strides for a shape of " << shape.size()
        << " dimensions";
    fail(msg.str());
  }
  if (size == 0) return;  // an empty view reaches nothing
  int64_t lo = op.offset, hi = op.offset;
  bool overflow = false;
  for (size_t j = 0; j < shape.size(); ++j) {
    int64_t reach;  // (shape-1)*stride: how far this dimension moves from the first element
    overflow |= __builtin_mul_overflow(shape[j] - 1, (*op.strides)[j], &reach);
    overflow |= __builtin_add_overflow(reach < 0 ? lo : hi, reach, reach < 0 ? &lo : &hi);
  }
  if (overflow || lo < 0 || hi >= static_cast<int64_t>(op.buffer_size)) {
    std::ostringstream msg;
    msg << fn << ": strided view of " << op.what << " (offset " << op.offset << ") reaches elements [" << lo
        << ", " << hi << "], outside the buffer of " << op.buffer_size << " elements";
    fail(msg.str());
  }
}

template <int N>
static Walk<N> make_walk(const char* fn, const std::vector<int64_t>& shape, const Operand (&ops)[N]) {
  Walk<N> w;
  int64_t size = 1;
  bool overflow = false;
  for (int64_t extent : shape) {
    if (extent < 0) fail(std::string(fn) + ": negative extent in shape");
    overflow |= __builtin_mul_overflow(size, extent, &size);
  }
  if (overflow) fail(std::string(fn) + ": shape is too large");
  w.size = static_cast<size_t>(size);
  for (int k = 0; k < N; ++k) {
    check_view(fn, shape, w.size, ops[k]);
    w.offset[k] = ops[k].offset;
  }
  if (size == 0) return w;
  for (size_t j = 0; j < shape.size(); ++j) {
    if (shape[j] == 1) continue;
    bool merge = !w.shape.empty();
    for (int k = 0; k < N && merge; ++k) merge = w.strides[k].back() == (*ops[k].strides)[j] * shape[j];
    if (merge) {
      w.shape.back() *= shape[j];
      for (int k = 0; k < N; ++k) w.strides[k].back() = (*ops[k].strides)[j];
    } else {
      w.shape.push_back(shape[j]);
      for (int k = 0; k < N; ++k) w.strides[k].push_back((*ops[k].strides)[j]);
    }
  }
  if (w.shape.empty()) {  // a single element
    w.shape.push_back(1);
    for (int k = 0; k < N; ++k) w.strides[k].push_back(1);
  }
  return w;
}

// Visits elements [begin, end) of the walk run by run: inner(pos, i, len, step) where pos[k] is the buffer
// position of operand k's first element of the run, i the run's first row-major index, len its length and
// step[k] operand k's stride along the run.  Runs never cross the end of the innermost dimension, so a range
// that starts or ends mid-row (a thread's share) gives a shorter first or last run.
//
// The multi-index of the outer dimensions is an odometer.  pos is kept up to date incrementally: incrementing
// idx[j] adds strides[k][j]; when idx[j] reaches shape[j] it wraps to 0, which subtracts
// (shape[j] - 1) * strides[k][j], and the next dimension to the left is incremented.  Only the starting point
// is computed from scratch, by reading the digits of begin / len off like those of a number.
template <int N, class F>
static void for_each_run_in_range(const Walk<N>& w, size_t begin, size_t end, F inner) {
  if (begin >= end) return;
  const int outer = static_cast<int>(w.shape.size()) - 1;
  const size_t len = static_cast<size_t>(w.shape[outer]);
  std::vector<int64_t> idx(outer, 0);
  int64_t pos[N], step[N];
  for (int k = 0; k < N; ++k) {
    pos[k] = w.offset[k];
    step[k] = w.strides[k][outer];
  }
  size_t rest = begin / len;
  for (int j = outer - 1; j >= 0; --j) {
    idx[j] = static_cast<int64_t>(rest % static_cast<size_t>(w.shape[j]));
    rest /= static_cast<size_t>(w.shape[j]);
    for (int k = 0; k < N; ++k) pos[k] += idx[j] * w.strides[k][j];
  }
  size_t j0 = begin % len;  // where in its row the first run starts
  for (size_t i = begin; i < end; j0 = 0) {
    const size_t n = std::min(len - j0, end - i);
    int64_t start[N];
    for (int k = 0; k < N; ++k) start[k] = pos[k] + static_cast<int64_t>(j0) * step[k];
    inner(start, i, static_cast<int64_t>(n), step);
    i += n;
    for (int j = outer - 1; j >= 0; --j) {  // the odometer
      if (++idx[j] < w.shape[j]) {
        for (int k = 0; k < N; ++k) pos[k] += w.strides[k][j];
        break;
      }
      for (int k = 0; k < N; ++k) pos[k] -= (w.shape[j] - 1) * w.strides[k][j];
      idx[j] = 0;
    }
  }
}

// Rows of a walk: the runs of its innermost dimension.
template <int N>
static size_t walk_rows(const Walk<N>& w) {
  return w.size / static_cast<size_t>(w.shape.back());
}

// Whether some operand moves across memory along the runs (|stride| > 1), as a transposed view does.  Walking
// such a view row by row touches a new cache line (often a new page) for every element; for_each_tile_run
// visits the same runs in cache-sized tiles instead.
template <int N>
static bool wants_tiles(const Walk<N>& w) {
  if (w.size == 0 || w.shape.size() < 2 || w.shape.back() < 2) return false;
  for (int k = 0; k < N; ++k) {
    const int64_t step = w.strides[k].back();
    if (step > 1 || step < -1) return true;
  }
  return false;
}

// Like for_each_run_in_range over whole rows [row_begin, row_end), but in tiles of TILE_ROWS rows x TILE_COLS columns:
// the start positions of TILE_ROWS consecutive rows are taken from the odometer first, then each column
// stretch of the tile is visited row after row.  In a transposed operand consecutive rows are neighbours in
// memory, so a tile reads whole cache lines of it while the compact side stays in L1.  Every run is still a
// piece of one row, so the callback's (pos, i, len, step) mean what they mean for for_each_run_in_range.
constexpr int64_t TILE_ROWS = 32, TILE_COLS = 32;

template <int N, class F>
static void for_each_tile_run(const Walk<N>& w, size_t row_begin, size_t row_end, F inner) {
  if (row_begin >= row_end) return;
  const int outer = static_cast<int>(w.shape.size()) - 1;
  const int64_t len = w.shape[outer];
  std::vector<int64_t> idx(outer, 0);
  int64_t pos[N], step[N];
  for (int k = 0; k < N; ++k) {
    pos[k] = w.offset[k];
    step[k] = w.strides[k][outer];
  }
  size_t rest = row_begin;
  for (int j = outer - 1; j >= 0; --j) {
    idx[j] = static_cast<int64_t>(rest % static_cast<size_t>(w.shape[j]));
    rest /= static_cast<size_t>(w.shape[j]);
    for (int k = 0; k < N; ++k) pos[k] += idx[j] * w.strides[k][j];
  }
  int64_t row_pos[TILE_ROWS][N];
  for (size_t r0 = row_begin; r0 < row_end; r0 += TILE_ROWS) {
    const int64_t rows = static_cast<int64_t>(std::min<size_t>(TILE_ROWS, row_end - r0));
    for (int64_t t = 0; t < rows; ++t) {
      for (int k = 0; k < N; ++k) row_pos[t][k] = pos[k];
      for (int j = outer - 1; j >= 0; --j) {  // the odometer, as in for_each_run_in_range
        if (++idx[j] < w.shape[j]) {
          for (int k = 0; k < N; ++k) pos[k] += w.strides[k][j];
          break;
        }
        for (int k = 0; k < N; ++k) pos[k] -= (w.shape[j] - 1) * w.strides[k][j];
        idx[j] = 0;
      }
    }
    for (int64_t c0 = 0; c0 < len; c0 += TILE_COLS) {
      const int64_t n = std::min(TILE_COLS, len - c0);
      for (int64_t t = 0; t < rows; ++t) {
        int64_t start[N];
        for (int k = 0; k < N; ++k) start[k] = row_pos[t][k] + c0 * step[k];
        inner(start, (r0 + static_cast<size_t>(t)) * static_cast<size_t>(len) + static_cast<size_t>(c0), n, step);
      }
    }
  }
}

// Every run of the walk, each exactly once, on `nthreads` threads: tiled when wants_tiles, else row by row.
template <int N, class F>
static void for_each_run(const Walk<N>& w, int nthreads, F inner) {
  if (wants_tiles(w)) {
    parallel_range(walk_rows(w), nthreads,
                   [&](size_t begin, size_t end) { for_each_tile_run(w, begin, end, inner); });
  } else {
    parallel_range(w.size, nthreads, [&](size_t begin, size_t end) { for_each_run_in_range(w, begin, end, inner); });
  }
}

// A walk over the single view (shape, strides, offset) of a buffer of buffer_size elements.
static Walk<1> make_view(const char* fn, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                         int64_t offset, size_t buffer_size) {
  const Operand ops[1] = {{"the array", &strides, offset, buffer_size}};
  return make_walk(fn, shape, ops);
}

}  // namespace cpu
}  // namespace needle
