// threads.h -- threads (OpenMP): how many a loop of n elements gets (num_threads, threads_for) and
// parallel_range, which spreads [0, n) over them in chunks.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace needle {
namespace cpu {

// libgomp's thread pool does not survive fork(): a child that opened a parallel region would wait forever for
// threads that exist only in the parent.  So a forked child (multiprocessing workers, say) runs single-threaded.
static std::atomic<bool> g_forked{false};

static inline int num_threads() {
#ifdef _OPENMP
  if (g_forked.load(std::memory_order_relaxed)) return 1;
  return omp_get_max_threads();  // OMP_NUM_THREADS, default: number of cores
#else
  return 1;
#endif
}

// Element-wise loops this long (or longer) of expensive functions (exp, log, tanh, pow) run on all threads.
constexpr size_t PARALLEL_TRANSCENDENTAL = 1 << 15;

// Runs body(begin, end) over [0, n): on one thread, or on `nthreads` taking chunks of about n / (8 nthreads)
// elements (whole multiples of 64, so no two threads write into one cache line of a compact output) as they
// become free.  Chunks rather than one share per thread: on a shared machine a thread may start late or be
// preempted, and the others then take over its share instead of waiting for it.
template <class F>
static void parallel_range(size_t n, int nthreads, F body) {
  if (nthreads <= 1 || n < 2 * 64) {
    body(size_t(0), n);
    return;
  }
  const size_t chunk = std::max<size_t>(64, (n / (8 * static_cast<size_t>(nthreads)) + 63) / 64 * 64);
  const int64_t chunks = static_cast<int64_t>((n + chunk - 1) / chunk);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
  for (int64_t c = 0; c < chunks; ++c) {
    const size_t begin = static_cast<size_t>(c) * chunk;
    body(begin, std::min(n, begin + chunk));
  }
}

// Threads for an element-wise loop over n elements: expensive functions (exp, log, tanh, pow) are split from
// PARALLEL_TRANSCENDENTAL elements on; cheap ones (add, max, ...) are limited by memory bandwidth and only pay
// for the threads from PARALLEL_CHEAP on.
constexpr size_t PARALLEL_CHEAP = size_t(1) << 20;
static int threads_for(size_t n, bool expensive) {
  return n >= (expensive ? PARALLEL_TRANSCENDENTAL : PARALLEL_CHEAP) ? num_threads() : 1;
}

}  // namespace cpu
}  // namespace needle
