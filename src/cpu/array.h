// array.h -- Array, the module's buffer: `size` elements of one dtype, counted by the memory statistics from
// construction until the Python object dies; the allocator behind it (C library heap for small buffers, mapped
// pages with a cache of freed ones for large ones); the contract's memory functions (memory_stats,
// reset_peak_memory_stats, set_memory_limit, set_cache_limit, empty_cache); and the dtype checks on Arrays that
// kernels share (same_float_dtype, require_float32).
//
// Python owns shape / strides / offset: an Array never knows them.
#pragma once

#include "common.h"
#include "dtypes.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

namespace needle {
namespace cpu {

// Raised by the allocator; translated to Python's MemoryError (with this message) in the module definition.
class NeedleMemoryError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Accounting counts the *requested* bytes, size * sizeof(float), of every live Array: not the bytes the
// allocator really reserves (rounded up to a multiple of ALIGNMENT, at least ALIGNMENT, or to whole pages).  So
// current_bytes is exactly the sum of 4*size over live Arrays, which is what tests and users can predict.
//
// Where the bytes come from.  Buffers below MAP_THRESHOLD come from the C library (aligned_alloc).  Buffers of
// MAP_THRESHOLD and more are mapped from the operating system on their own (mmap) and given back when they die
// (munmap), so the process's resident memory follows current_bytes.  The C library would keep them: glibc raises
// its own mmap threshold each time it frees a mapped block (up to 32 MiB), after which blocks of that size live
// in its heap, and a freed heap block below a live one is never returned (measured: three rounds of 200 x 4 MiB
// with a small live array after each left 1.4 GB resident with 0 bytes held).  Why 1 MiB: it maps the buffers
// that matter for memory (a 4096 x 256 activation is 4 MiB) and leaves the many small ones (biases, reductions,
// small matmuls) to the heap, where an allocation is a few tens of nanoseconds and not a system call.
//
// A fresh mapping is zero pages that fault in on first touch: the kernel zeroes them (and, for the huge-page
// hint, may first compact memory to find 2 MiB pages), about one pass over the buffer at best.  A training step
// frees and asks again for the same sizes every step, so freed mapped blocks of a *recurring* size go into a
// cache (exact page-rounded sizes, the most recently freed first; the oldest are unmapped when it overflows),
// from which a request of the same size is served without asking the kernel.  Two rules keep both promises,
// "freed memory goes back to the OS" and "a repeated step takes no page faults":
//   - A size recurs once it is asked for again after a block of that size went back to the kernel.  Until then
//     a freed block of that size is unmapped at once: `del` of a big array lowers resident memory right away,
//     while a training step's sizes recur within its first step or two and are kept from then on.
//   - The cache holds at most 1.15 x the high-water mark (the most bytes ever live at once) + 32 MiB, less what
//     is live now, so resident memory never exceeds that bound (as CUDA's caching allocator keeps its blocks,
//     but bounded).  The 15% + 32 MiB of slack is what keeps a step that frees blocks of one size and asks for
//     another near its peak from giving back what it asks for again later (a cap of exactly high water - live
//     did: 2,600 page faults a step on the benchmark model; with the slack 0-19, as with no bound at all).
// set_cache_limit(n) bounds the cache further to n bytes (0: every freed block is unmapped at once, so resident
// memory follows current_bytes).  Under set_memory_limit the cache never holds more than the limit.  The cache
// is resident memory that current_bytes does not count, so it is reported: memory_stats()["cached_bytes"] (and
// "reserved_bytes" = current_bytes + cached_bytes, as CUDA's reserved bytes count live plus cached blocks);
// empty_cache() unmaps it, as does an allocation the kernel refuses.
constexpr size_t MAP_THRESHOLD = size_t(1) << 20;
constexpr size_t CACHE_SLACK_BYTES = size_t(32) << 20;  // the bound's + 32 MiB
constexpr size_t MAX_TRACKED_SIZES = 4096;  // sizes remembered as returned; forgotten all at once beyond this
constexpr size_t AUTO_CACHE = std::numeric_limits<size_t>::max();
constexpr size_t HUGE_PAGE = size_t(2) << 20;

struct CachedBlock {
  size_t bytes;
  void* ptr;
};

struct MemoryStats {
  std::mutex mu;
  size_t current_bytes = 0;
  size_t peak_bytes = 0;
  size_t allocations = 0;  // number of live Arrays
  size_t limit_bytes = 0;  // 0 = no limit
  size_t high_water_bytes = 0;       // the most bytes ever live at once (never reset)
  size_t cache_limit = AUTO_CACHE;   // set_cache_limit's bytes, or AUTO_CACHE: the bound in cache_capacity
  size_t cached_bytes = 0;           // sum of cache[i].bytes
  size_t cached_bytes_at_peak = 0;   // cached_bytes when peak_bytes was last raised (or reset)
  std::vector<CachedBlock> cache;    // freed mapped blocks, oldest first
  std::unordered_set<size_t> returned;   // sizes of blocks that went back to the kernel (not yet recurring)
  std::unordered_set<size_t> recurring;  // sizes asked for again after that: their freed blocks are cached
};

// Never destroyed, so Arrays that die during interpreter shutdown still find it.
static MemoryStats& stats() {
  static MemoryStats* s = new MemoryStats();
  return *s;
}

static size_t page_size() {
  static const size_t p = [] {
    const long v = sysconf(_SC_PAGESIZE);
    return v > 0 ? static_cast<size_t>(v) : size_t(4096);
  }();
  return p;
}

// A large buffer is fresh memory from the kernel, and first touching it faults in one 4 KiB page at a time.
// Asking for transparent huge pages on its 2 MiB-aligned interior, as NumPy does for its large arrays, makes
// that 512 times fewer faults.  Only a hint: ignored where THP is off.
static void advise_huge_pages(void* ptr, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes < 2 * HUGE_PAGE) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(ptr) + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(ptr) + bytes) & ~(HUGE_PAGE - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)ptr;
  (void)bytes;
#endif
}

// A new mapping of `bytes` (a multiple of the page size), or nullptr.  Mappings that get the huge-page hint
// start on a 2 MiB boundary (map a little more, unmap the ends), so all of them but a partial last huge page
// can be huge pages.
static void* map_pages(size_t bytes) {
  const bool huge = bytes >= 2 * HUGE_PAGE;
  const size_t span = huge ? bytes + HUGE_PAGE : bytes;
  void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  if (huge) {
    const uintptr_t raw = reinterpret_cast<uintptr_t>(p);
    const uintptr_t start = (raw + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    if (start > raw) munmap(p, start - raw);
    if (raw + span > start + bytes) munmap(reinterpret_cast<void*>(start + bytes), raw + span - start - bytes);
    p = reinterpret_cast<void*>(start);
  }
  advise_huge_pages(p, bytes);
  return p;
}

// Unmaps every cached block.  Caller holds s.mu.
static void release_cache(MemoryStats& s) {
  for (const CachedBlock& b : s.cache) munmap(b.ptr, b.bytes);
  s.cache.clear();
  s.cached_bytes = 0;
}

// How many bytes the cache may hold now: 1.15 x the high-water mark + 32 MiB, less what is live, so that live
// plus cached bytes stay within that bound; or set_cache_limit's bytes; never more than set_memory_limit's.
// Caller holds s.mu.
static size_t cache_capacity(const MemoryStats& s) {
  size_t cap = s.cache_limit;
  if (cap == AUTO_CACHE) {
    const size_t bound = s.high_water_bytes + s.high_water_bytes / 100 * 15 + CACHE_SLACK_BYTES;
    cap = bound - std::min(bound, s.current_bytes);
  }
  if (s.limit_bytes != 0) cap = std::min(cap, s.limit_bytes);
  return cap;
}

// Unmaps the oldest cached blocks until at most `cap` bytes are cached.  Caller holds s.mu.
static void trim_cache(MemoryStats& s, size_t cap) {
  size_t drop = 0, dropped = 0;
  while (s.cached_bytes - dropped > cap) dropped += s.cache[drop++].bytes;
  for (size_t i = 0; i < drop; ++i) munmap(s.cache[i].ptr, s.cache[i].bytes);
  s.cache.erase(s.cache.begin(), s.cache.begin() + static_cast<std::ptrdiff_t>(drop));
  s.cached_bytes -= dropped;
}

// A block of exactly `bytes` (page-rounded): the most recently freed one in the cache, else a new mapping, else
// (the kernel refused) a new mapping after the cache is unmapped; nullptr if even that fails.  Caller holds s.mu.
static void* get_mapped(MemoryStats& s, size_t bytes) {
  for (size_t i = s.cache.size(); i-- > 0;) {
    if (s.cache[i].bytes == bytes) {
      void* p = s.cache[i].ptr;
      s.cache.erase(s.cache.begin() + static_cast<std::ptrdiff_t>(i));
      s.cached_bytes -= bytes;
      return p;
    }
  }
  if (s.returned.erase(bytes) != 0) s.recurring.insert(bytes);  // asked for again: keep this size from now on
  void* p = map_pages(bytes);
  if (p == nullptr && !s.cache.empty()) {
    release_cache(s);
    p = map_pages(bytes);
  }
  return p;
}

// A mapped block whose Array died: into the cache if its size recurs and it fits (unmapping the oldest blocks to
// make room), else unmapped (and its size remembered, so that a later request of it makes the size recurring).
// Caller holds s.mu.
static void put_mapped(MemoryStats& s, void* ptr, size_t bytes) {
  const size_t cap = cache_capacity(s);
  if (bytes > cap || s.recurring.count(bytes) == 0) {
    munmap(ptr, bytes);
    if (s.returned.size() >= MAX_TRACKED_SIZES) s.returned.clear();
    s.returned.insert(bytes);
    return;
  }
  trim_cache(s, cap - bytes);
  s.cache.push_back({bytes, ptr});
  s.cached_bytes += bytes;
}

struct Array {
  explicit Array(size_t n, DType dt = DType::f32) : size(n), dtype(dt), itemsize(info(dt).itemsize) {
    // Bytes that aligned_alloc gets: a non-zero multiple of ALIGNMENT, as C11/C++17 require.
    if (n > (std::numeric_limits<size_t>::max() - 2 * HUGE_PAGE) / itemsize) {
      std::ostringstream msg;
      msg << "needle cpu: cannot allocate an array of " << n << " " << info(dt).name
          << " elements (size overflows)";
      throw NeedleMemoryError(msg.str());
    }
    const size_t bytes = n * itemsize;
    const size_t alloc_bytes = std::max(ALIGNMENT, (bytes + ALIGNMENT - 1) / ALIGNMENT * ALIGNMENT);
    MemoryStats& s = stats();
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.limit_bytes != 0 && bytes > s.limit_bytes - std::min(s.limit_bytes, s.current_bytes)) {
      std::ostringstream msg;
      msg << "needle cpu: cannot allocate " << bytes << " bytes: " << s.current_bytes << " bytes held, limit "
          << s.limit_bytes << " bytes";
      throw NeedleMemoryError(msg.str());
    }
    if (alloc_bytes >= MAP_THRESHOLD) {
      const size_t page = page_size();
      mapped_bytes = (alloc_bytes + page - 1) / page * page;
      ptr = static_cast<scalar_t*>(get_mapped(s, mapped_bytes));  // page-aligned, so ALIGNMENT-aligned
    } else {
      ptr = static_cast<scalar_t*>(std::aligned_alloc(ALIGNMENT, alloc_bytes));
    }
    if (ptr == nullptr) {
      std::ostringstream msg;
      msg << "needle cpu: cannot allocate " << bytes << " bytes: " << s.current_bytes
          << " bytes held, the system is out of memory";
      throw NeedleMemoryError(msg.str());
    }
    s.current_bytes += bytes;
    if (s.current_bytes > s.peak_bytes) {
      s.peak_bytes = s.current_bytes;
  s.cached_bytes_at_peak = s.cached_bytes;
      s.cached_bytes_at_peak = s.cached_bytes;
    }
    s.high_water_bytes = std::max(s.high_water_bytes, s.current_bytes);
    s.allocations += 1;
  }
  ~Array() {
    MemoryStats& s = stats();
    std::lock_guard<std::mutex> lock(s.mu);
    s.current_bytes -= size * itemsize;
    if (mapped_bytes != 0) {
      put_mapped(s, ptr, mapped_bytes);
    } else {
      std::free(ptr);
    }
    s.allocations -= 1;
  }
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;

  size_t ptr_as_int() const { return reinterpret_cast<size_t>(ptr); }
  // The elements as their storage type (T must match dtype: the visit_* functions guarantee it).
  template <class T>
  T* data() const {
    return reinterpret_cast<T*>(ptr);
  }
  std::string dtype_name() const { return info(dtype).name; }

  scalar_t* ptr = nullptr;  // the buffer; read as float only when dtype is float32
  size_t size;
  DType dtype;
  size_t itemsize;
  size_t mapped_bytes = 0;  // bytes of ptr's own mapping; 0 if ptr came from aligned_alloc
};

// TypeError unless every array is floating and of one dtype (which is returned).
static DType same_float_dtype(const char* fn, std::initializer_list<const Array*> arrays) {
  const DType d = (*arrays.begin())->dtype;
  bool ok = info(d).floating;
  for (const Array* a : arrays) ok = ok && a->dtype == d;
  if (!ok) {
    std::ostringstream msg;
    msg << fn << ": needs floating arrays of one dtype, got";
    for (const Array* a : arrays) msg << " " << info(a->dtype).name;
    throw py::type_error(msg.str());
  }
  return d;
}

static void require_float32(const char* fn, std::initializer_list<const Array*> arrays) {
  for (const Array* a : arrays)
    if (a->dtype != DType::f32)
      throw py::type_error(std::string(fn) + ": float32 only, got " + info(a->dtype).name);
}

static py::dict memory_stats() {
  MemoryStats& s = stats();
  std::lock_guard<std::mutex> lock(s.mu);
  py::dict d;
  d["current_bytes"] = s.current_bytes;
  d["peak_bytes"] = s.peak_bytes;
  d["cached_bytes_at_peak"] = s.cached_bytes_at_peak;  // resident but free when peak_bytes was reached
  d["allocations"] = s.allocations;
  d["cached_bytes"] = s.cached_bytes;
  d["reserved_bytes"] = s.current_bytes + s.cached_bytes;
  d["high_water_bytes"] = s.high_water_bytes;  // the most bytes ever live at once: what the cache's bound is of
  return d;
}

static void empty_cache() {
  MemoryStats& s = stats();
  std::lock_guard<std::mutex> lock(s.mu);
  release_cache(s);
}

static void set_cache_limit(int64_t nbytes) {
  if (nbytes < -1) throw py::value_error("set_cache_limit: nbytes must be >= 0, or -1 for the default");
  MemoryStats& s = stats();
  std::lock_guard<std::mutex> lock(s.mu);
  s.cache_limit = nbytes == -1 ? AUTO_CACHE : static_cast<size_t>(nbytes);
  trim_cache(s, cache_capacity(s));
}

static void reset_peak_memory_stats() {
  MemoryStats& s = stats();
  std::lock_guard<std::mutex> lock(s.mu);
  s.peak_bytes = s.current_bytes;
  s.cached_bytes_at_peak = s.cached_bytes;
}

static void set_memory_limit(int64_t nbytes) {
  if (nbytes < 0) throw py::value_error("set_memory_limit: nbytes must be >= 0 (0 removes the limit)");
  MemoryStats& s = stats();
  std::lock_guard<std::mutex> lock(s.mu);
  s.limit_bytes = static_cast<size_t>(nbytes);
  trim_cache(s, cache_capacity(s));
}

}  // namespace cpu
}  // namespace needle
