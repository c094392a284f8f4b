// needle's C++ CPU backend: the pybind11 module `ndarray_backend_cpu`.
//
// It implements exactly the functions listed in src/README.md (the NumPy module ndarray_backend_numpy.py is the
// executable specification).  Python owns shape / strides / offset; this module only ever sees flat float32
// buffers (`Array`) plus the (shape, strides, offset) of a view, all in *elements*.  Python checks every view
// before it gets here; we still check cheap invariants (sizes, view bounds, index ranges) and raise Python
// exceptions (ValueError / IndexError / MemoryError) instead of crashing.
//
// Layout of this file:
//   1. Array + memory accounting
//   2. strided views: compact / ewise_setitem / scalar_setitem / to_numpy
//   3. element-wise and scalar ops (on compact buffers and on strided views), reductions, gathers and scatters,
//      stochastic rounding and block-wise 8-bit quantization
//   4. matmul (the fast, cache-blocked, packed, register-tiled GEMM), matmul_batched and matmul_tiled (the
//      course's version)
//   5. the pybind11 module definition

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
// The bfloat16 dot-product matmul kernel (section 4) is written with intrinsics, which need a compiler that knows
// AVX512-BF16 (GCC 10, clang 9); everything else uses GCC vector extensions.
#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 9 : (defined(__GNUC__) && __GNUC__ >= 10))
#define NEEDLE_HAVE_IMMINTRIN 1
#include <immintrin.h>
#endif
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

namespace needle {
namespace cpu {

namespace py = pybind11;

typedef float scalar_t;
constexpr size_t ELEM_SIZE = sizeof(scalar_t);
// Every buffer starts on a 64-byte boundary (one cache line).  Nothing below relies on it for correctness:
// views carry offsets, so kernels always use unaligned loads/stores.
constexpr size_t ALIGNMENT = 64;
constexpr int TILE = 8;  // __tile_size__ of matmul_tiled

// ------------------------------------------------------------------------------------------------------------
// 1. Array + memory accounting
// ------------------------------------------------------------------------------------------------------------

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
// frees and asks again for the same sizes every step, so freed mapped blocks go into a cache (exact page-rounded
// sizes, the most recently freed first; the oldest are unmapped when it overflows), from which a request of the
// same size is served without asking the kernel.  How much it may hold: by default as many bytes as were ever
// live at once (at least 64 MiB), so a repeated step runs without page faults and resident memory stays below
// twice the high-water mark, as CUDA's caching allocator keeps its blocks; set_cache_limit(n) bounds it to
// n bytes (0: every freed block is unmapped at once, so resident memory follows current_bytes).  Measured on the
// benchmark model with gc off, 2 threads: 1.6-2.1 s a step with a 64 MiB cache (4,000 huge-page faults, up to
// 1.2 s of system time compacting and zeroing) vs 1.05 s with the default.  Under set_memory_limit the cache
// never holds more than the limit.  The cache is resident memory that current_bytes does not count, so it is
// reported: memory_stats()["cached_bytes"] (and "reserved_bytes" = current_bytes + cached_bytes, as CUDA's
// reserved bytes count live plus cached blocks); empty_cache() unmaps it, as does an allocation the kernel
// refuses.
constexpr size_t MAP_THRESHOLD = size_t(1) << 20;
constexpr size_t MIN_AUTO_CACHE = size_t(64) << 20;
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
  size_t cache_limit = AUTO_CACHE;   // set_cache_limit's bytes, or AUTO_CACHE: max(64 MiB, high_water_bytes)
  size_t cached_bytes = 0;           // sum of cache[i].bytes
  std::vector<CachedBlock> cache;    // freed mapped blocks, oldest first
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

// How many bytes the cache may hold.  By default as many as were ever live at once (at least 64 MiB): a step
// frees and asks again for blocks of many sizes, and one that had to give back what it will ask for again
// later (a cap of high water - live would, near the peak) faults those pages in again every step.  So resident
// memory stays below twice the high-water mark.  Caller holds s.mu.
static size_t cache_capacity(const MemoryStats& s) {
  size_t cap = s.cache_limit;
  if (cap == AUTO_CACHE) cap = std::max(MIN_AUTO_CACHE, s.high_water_bytes);
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
  void* p = map_pages(bytes);
  if (p == nullptr && !s.cache.empty()) {
    release_cache(s);
    p = map_pages(bytes);
  }
  return p;
}

// A mapped block whose Array died: into the cache if it fits (unmapping the oldest blocks to make room), else
// unmapped.  Caller holds s.mu.
static void put_mapped(MemoryStats& s, void* ptr, size_t bytes) {
  const size_t cap = cache_capacity(s);
  if (bytes > cap) {
    munmap(ptr, bytes);
    return;
  }
  trim_cache(s, cap - bytes);
  s.cache.push_back({bytes, ptr});
  s.cached_bytes += bytes;
}

// ---- dtypes --------------------------------------------------------------------------------------------------
//
// A buffer stores one dtype; arithmetic is always float32 (src/README.md, "Dtypes").  Kernels are written once
// over the storage type T: they read with to_float(T), compute in float and write with from_float<T>, which for
// T = float are the identity, so the float32 code is what it was.  bfloat16 is the upper half of a float32 (same
// exponent, 7 mantissa bits), so widening is a shift and narrowing rounds the lower half away (nearest, ties to
// even); float16 has its own integer conversions below.
enum class DType : uint8_t { f32, f16, bf16, i8, u8, i32 };

struct DTypeInfo {
  const char* name;     // needle's name
  const char* numpy;    // the numpy type to_numpy returns (bfloat16: its bits as uint16)
  size_t itemsize;
  bool floating;
};
constexpr DTypeInfo DTYPE_INFO[] = {{"float32", "float32", 4, true}, {"float16", "float16", 2, true},
                                    {"bfloat16", "uint16", 2, true}, {"int8", "int8", 1, false},
                                    {"uint8", "uint8", 1, false},    {"int32", "int32", 4, false}};
static const DTypeInfo& info(DType d) { return DTYPE_INFO[static_cast<int>(d)]; }

static DType parse_dtype(const std::string& name) {
  for (int d = 0; d < 6; ++d)
    if (name == DTYPE_INFO[d].name) return static_cast<DType>(d);
  throw py::value_error("Array: unknown dtype '" + name +
                        "' (expected float32, float16, bfloat16, int8, uint8 or int32)");
}

struct bfloat16_t {
  uint16_t bits;
};
struct half_t {
  uint16_t bits;
};

static inline float float_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint32_t bits_from_float(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

static inline float to_float(float x) { return x; }
static inline float to_float(bfloat16_t x) { return float_from_bits(uint32_t(x.bits) << 16); }
// float16 <-> float32 in integer arithmetic (F. Giesen's branch-light conversions), bit for bit what the compiler's
// _Float16 casts give (checked over all 2^16 and 2^32 inputs) but without their library calls, so loops vectorize.
// Widening: move the exponent and mantissa into float32 position and rebias the exponent by 127 - 15; inf/NaN
// (exponent 31) get the rest of the way to 255 (a NaN comes back quiet), and a subnormal half, whose value is
// mantissa * 2^-24, is renormalized by one float subtraction.
static inline float to_float(half_t x) {
  uint32_t u = uint32_t(x.bits & 0x7fffu) << 13;
  const uint32_t exponent = u & 0x0f800000u;
  u += uint32_t(127 - 15) << 23;
  if (exponent == 0x0f800000u) {
    u += uint32_t(128 - 16) << 23;
    if (x.bits & 0x3ffu) u |= 0x00400000u;
  } else if (exponent == 0) {
    u += 1u << 23;
    u = bits_from_float(float_from_bits(u) - float_from_bits(113u << 23));
  }
  return float_from_bits(u | (uint32_t(x.bits & 0x8000u) << 16));
}
template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>
static inline float to_float(I x) {
  return static_cast<float>(x);
}

template <class T>
static inline T from_float(float x);
template <>
inline float from_float<float>(float x) {
  return x;
}
// Adding 0x7fff plus the lowest kept bit, then truncating, rounds to nearest with ties to even; a carry out of
// the mantissa bumps the exponent, which is exactly right (up to +inf).  NaN is kept quiet, never rounded to inf.
template <>
inline bfloat16_t from_float<bfloat16_t>(float x) {
  const uint32_t u = bits_from_float(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x0040u)};
  return {static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
// Narrowing, nearest with ties to even: |x| >= 65536, inf and NaN (kept quiet, with its upper payload bits) first;
// below 2^-14 the result is a subnormal half, and adding 0.5f lets the float adder round x at 2^-24 (the half's
// subnormal step), leaving the half's bits in the low mantissa; otherwise rebias the exponent and round the 13
// dropped mantissa bits by adding 0xfff plus the lowest kept bit (a carry bumps the exponent, up to inf).
template <>
inline half_t from_float<half_t>(float x) {
  const uint32_t u = bits_from_float(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a >= 0x47800000u) return {static_cast<uint16_t>(sign | (a > 0x7f800000u ? 0x7e00u | ((a >> 13) & 0x3ffu)
                                                                               : 0x7c00u))};
  if (a < 0x38800000u)
    return {static_cast<uint16_t>(sign | (bits_from_float(float_from_bits(a) + 0.5f) - 0x3f000000u))};
  a += (uint32_t(15 - 127) << 23) + 0xfffu + ((a >> 13) & 1u);
  return {static_cast<uint16_t>(sign | (a >> 13))};
}
// Float to integer: the fraction is dropped (toward zero), values saturate, NaN is 0.
template <class I>
static inline I saturate_float(float x) {
  constexpr I lo = std::numeric_limits<I>::min(), hi = std::numeric_limits<I>::max();
  if (x != x) return 0;
  if (x <= static_cast<float>(lo)) return lo;
  if (x >= static_cast<float>(hi)) return hi;  // (float(INT32_MAX) rounds up to 2^31, so >= is the test)
  return static_cast<I>(x);
}
template <>
inline int8_t from_float<int8_t>(float x) {
  return saturate_float<int8_t>(x);
}
template <>
inline uint8_t from_float<uint8_t>(float x) {
  return saturate_float<uint8_t>(x);
}
template <>
inline int32_t from_float<int32_t>(float x) {
  return saturate_float<int32_t>(x);
}

// One element of dtype From as dtype To, by the contract's rules (integers to integers saturate exactly).
template <class To, class From>
static inline To convert(From x) {
  if constexpr (std::is_same<To, From>::value) {
    return x;
  } else if constexpr (std::is_integral<To>::value && std::is_integral<From>::value) {
    const int64_t v = static_cast<int64_t>(x);
    return static_cast<To>(std::min<int64_t>(std::max<int64_t>(v, std::numeric_limits<To>::min()),
                                             std::numeric_limits<To>::max()));
  } else {
    return from_float<To>(to_float(x));
  }
}

// Calls f(T()) with the storage type of dtype d: visit_float for the floating dtypes, visit_any for all.
template <class F>
static void visit_float(DType d, F&& f) {
  switch (d) {
    case DType::f32: return f(float());
    case DType::f16: return f(half_t());
    case DType::bf16: return f(bfloat16_t());
    default: throw py::type_error(std::string("needle cpu: ") + info(d).name + " is not a floating dtype");
  }
}
template <class F>
static void visit_any(DType d, F&& f) {
  switch (d) {
    case DType::i8: return f(int8_t());
    case DType::u8: return f(uint8_t());
    case DType::i32: return f(int32_t());
    default: return visit_float(d, f);
  }
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
    s.peak_bytes = std::max(s.peak_bytes, s.current_bytes);
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
  d["allocations"] = s.allocations;
  d["cached_bytes"] = s.cached_bytes;
  d["reserved_bytes"] = s.current_bytes + s.cached_bytes;
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
}

static void set_memory_limit(int64_t nbytes) {
  if (nbytes < 0) throw py::value_error("set_memory_limit: nbytes must be >= 0 (0 removes the limit)");
  MemoryStats& s = stats();
  std::lock_guard<std::mutex> lock(s.mu);
  s.limit_bytes = static_cast<size_t>(nbytes);
  trim_cache(s, cache_capacity(s));
}

// ------------------------------------------------------------------------------------------------------------
// small helpers
// ------------------------------------------------------------------------------------------------------------

[[noreturn]] static void fail(const std::string& msg) { throw py::value_error(msg); }

static void check_size(const char* fn, const char* what, size_t got, size_t expected) {
  if (got != expected) {
    std::ostringstream msg;
    msg << fn << ": " << what << " has " << got << " elements, expected " << expected;
    fail(msg.str());
  }
}

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

// ------------------------------------------------------------------------------------------------------------
// 2. Strided views
// ------------------------------------------------------------------------------------------------------------
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

// out[i] = a[view element i], converted from From to To (a plain copy when they agree)
template <class From, class To>
static void compact_into(const From* a, To* out, const Walk<1>& v) {
  for_each_run(v, 1, [&](const int64_t* pos, size_t i, int64_t len, const int64_t* step) {
    const From* src = a + pos[0];
    To* dst = out + i;
    if (std::is_same<From, To>::value && step[0] == 1) {
      std::memcpy(static_cast<void*>(dst), src, static_cast<size_t>(len) * sizeof(To));
    } else if (step[0] == 0) {
      std::fill(dst, dst + len, convert<To>(*src));
    } else {
      for (int64_t j = 0; j < len; ++j) dst[j] = convert<To>(src[j * step[0]]);
    }
  });
}

// Calls f(From(), To()) with the storage types of two dtypes.
template <class F>
static void visit_pair(DType from, DType to, F&& f) {
  visit_any(from, [&](auto x) { visit_any(to, [&](auto y) { f(x, y); }); });
}

static void compact(const Array& a, Array& out, const std::vector<int64_t>& shape,
                    const std::vector<int64_t>& strides, int64_t offset) {
  Walk<1> v = make_view("compact", shape, strides, offset, a.size);
  check_size("compact", "out", out.size, v.size);
  visit_pair(a.dtype, out.dtype, [&](auto x, auto y) {
    compact_into(a.data<decltype(x)>(), out.data<decltype(y)>(), v);
  });
}

static void ewise_setitem(const Array& a, Array& out, const std::vector<int64_t>& shape,
                          const std::vector<int64_t>& strides, int64_t offset) {
  Walk<1> v = make_view("ewise_setitem", shape, strides, offset, out.size);
  check_size("ewise_setitem", "a", a.size, v.size);
  visit_pair(a.dtype, out.dtype, [&](auto x, auto y) {
    using From = decltype(x);
    using To = decltype(y);
    const From* src0 = a.data<From>();
    To* base = out.data<To>();
    for_each_run(v, 1, [&](const int64_t* pos, size_t i, int64_t len, const int64_t* step) {
      const From* src = src0 + i;
      To* dst = base + pos[0];
      if (std::is_same<From, To>::value && step[0] == 1) {
        // a may be out itself (x[:] = x)
        std::memmove(static_cast<void*>(dst), src, static_cast<size_t>(len) * sizeof(To));
      } else {
        for (int64_t j = 0; j < len; ++j) dst[j * step[0]] = convert<To>(src[j]);
      }
    });
  });
}

static void scalar_setitem(int64_t size, scalar_t val, Array& out, const std::vector<int64_t>& shape,
                           const std::vector<int64_t>& strides, int64_t offset) {
  Walk<1> v = make_view("scalar_setitem", shape, strides, offset, out.size);
  if (size < 0 || static_cast<size_t>(size) != v.size) {
    std::ostringstream msg;
    msg << "scalar_setitem: size is " << size << " but the view has " << v.size << " elements";
    fail(msg.str());
  }
  visit_any(out.dtype, [&](auto t) {
    using T = decltype(t);
    const T value = convert<T>(val);
    T* base = out.data<T>();
    for_each_run(v, 1, [&](const int64_t* pos, size_t, int64_t len, const int64_t* step) {
      T* dst = base + pos[0];
      if (step[0] == 1) {
        std::fill(dst, dst + len, value);
      } else {
        for (int64_t j = 0; j < len; ++j) dst[j * step[0]] = value;
      }
    });
  });
}

static py::array to_numpy(const Array& a, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                          int64_t offset) {
  Walk<1> v = make_view("to_numpy", shape, strides, offset, a.size);
  std::vector<py::ssize_t> np_shape(shape.begin(), shape.end());
  py::array result(py::dtype(info(a.dtype).numpy), np_shape);
  visit_any(a.dtype, [&](auto t) {
    using T = decltype(t);
    compact_into(a.data<T>(), static_cast<T*>(result.mutable_data()), v);
  });
  return result;
}

// float32 buffers take any numeric numpy array (converted, as before dtypes existed); other dtypes take the
// storage type's bytes exactly (ndarray.py converts first).
static void from_numpy(py::array a, Array& out) {
  if (out.dtype == DType::f32) {
    auto f = py::array_t<scalar_t, py::array::c_style | py::array::forcecast>::ensure(a);
    if (!f) throw py::type_error("from_numpy: cannot convert the numpy array to float32");
    check_size("from_numpy", "the numpy array", static_cast<size_t>(f.size()), out.size);
    if (out.size) std::memcpy(out.ptr, f.data(), out.size * sizeof(scalar_t));
    return;
  }
  if (static_cast<size_t>(a.itemsize()) != out.itemsize || !(a.flags() & py::array::c_style)) {
    std::ostringstream msg;
    msg << "from_numpy: a " << out.dtype_name() << " buffer needs a C-contiguous array of " << out.itemsize
        << "-byte elements, got " << a.itemsize() << "-byte elements";
    throw py::type_error(msg.str());
  }
  check_size("from_numpy", "the numpy array", static_cast<size_t>(a.size()), out.size);
  if (out.size) std::memcpy(out.ptr, a.data(), out.size * out.itemsize);
}

static void fill(Array& out, scalar_t val) {
  visit_any(out.dtype, [&](auto t) {
    using T = decltype(t);
    std::fill(out.data<T>(), out.data<T>() + out.size, convert<T>(val));
  });
}



// ------------------------------------------------------------------------------------------------------------
// 3. Element-wise ops, reductions, gathers
// ------------------------------------------------------------------------------------------------------------
//
// 3a. Vector math: exp, log, tanh, row sums and row maxima written once over a GCC vector type F (4, 8 or 16
//     floats; no intrinsics), compiled once per instruction set and picked at import.
// 3b. Element-wise ops on compact buffers (the ewise_* and scalar_* functions).
// 3c. Element-wise ops on strided views (ewise_strided, scalar_strided, unary_strided): broadcast or
//     transposed operands are read in place, never compacted first.
// 3d. Reductions, gathers and scatters.
//
// Comparisons produce 1.0f / 0.0f; maximum propagates NaN like numpy.maximum.

// Threads for an element-wise loop over n elements: expensive functions (exp, log, tanh, pow) are split from
// PARALLEL_TRANSCENDENTAL elements on; cheap ones (add, max, ...) are limited by memory bandwidth and only pay
// for the threads from PARALLEL_CHEAP on.
constexpr size_t PARALLEL_CHEAP = size_t(1) << 20;
static int threads_for(size_t n, bool expensive) {
  return n >= (expensive ? PARALLEL_TRANSCENDENTAL : PARALLEL_CHEAP) ? num_threads() : 1;
}

// float32 -> bfloat16, rounding up with probability equal to the discarded fraction: a 16-bit random number is
// added to the lower half of the float32 bits before truncating (carries propagate into the exponent correctly).
// The random number is a hash of (seed, i), so results do not depend on threads and match the other backends.
static inline uint32_t lowbias32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7feb352du;
  h ^= h >> 15;
  h *= 0x846ca68bu;
  h ^= h >> 16;
  return h;
}

// dropout: out[i] = a[i] * m / (1 - p), m = 1 where the hash of (seed, i) is >= p * 2^32, else 0: attention's
// counter-based mask (src/README.md) on a flat index, so a mask is regenerated from its seed instead of kept.
static void dropout(const Array& a, Array& out, double p, uint32_t seed) {
  check_size("dropout", "out", out.size, a.size);
  if (!(p >= 0.0 && p < 1.0)) throw py::value_error("dropout: p must be in [0, 1), got " + std::to_string(p));
  const DType dt = same_float_dtype("dropout", {&a, &out});
  const uint32_t threshold = static_cast<uint32_t>(std::min(p * 4294967296.0, 4294967295.0));
  const uint32_t seed_key = seed * 0x9E3779B9u;
  const float keep = static_cast<float>(1.0 - p);
  visit_float(dt, [&](auto t) {
    using T = decltype(t);
    const T* pa = a.data<T>();
    T* po = out.data<T>();
    py::gil_scoped_release release;
    parallel_range(a.size, threads_for(a.size, true), [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) {
        const uint64_t idx = i;
        const uint32_t key = lowbias32(static_cast<uint32_t>(idx >> 32) ^ seed_key);
        const float m = lowbias32(static_cast<uint32_t>(idx) ^ key) >= threshold ? 1.0f : 0.0f;
        po[i] = from_float<T>(to_float(pa[i]) * m / keep);
      }
    });
  });
}

static void round_stochastic(const Array& a, Array& out, uint32_t seed) {
  if (a.dtype != DType::f32 || out.dtype != DType::bf16)
    throw py::type_error("round_stochastic: needs float32 a and bfloat16 out, got " + a.dtype_name() + " and " +
                         out.dtype_name());
  check_size("round_stochastic", "out", out.size, a.size);
  const float* pa = a.data<float>();
  bfloat16_t* po = out.data<bfloat16_t>();
  const uint32_t key = seed * 0x9E3779B9u;
  parallel_range(a.size, threads_for(a.size, false), [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const uint32_t u = bits_from_float(pa[i]);
      if ((u & 0x7f800000u) == 0x7f800000u) {  // inf or NaN: as plain rounding
        po[i] = from_float<bfloat16_t>(pa[i]);
      } else {
        po[i] = {static_cast<uint16_t>((u + (lowbias32(static_cast<uint32_t>(i) ^ key) & 0xffffu)) >> 16)};
      }
    }
  });
}

// ---- block-wise 8-bit quantization (Dettmers et al. 2021) ----------------------------------------------------
//
// quantize_blockwise: the n elements of a are cut into blocks of block_size (the last one may be shorter); each
// block is one task (blocks are spread over the threads) that first finds the block's absmax and then maps every
// element x = a[i] / absmax to the index of the nearest value of `code` (256 float32 values, strictly
// ascending), exactly as src/README.md words it.  dequantize_blockwise multiplies back.
constexpr size_t CODE_SIZE = 256;

// The nearest code value, fast: a first guess from a table indexed by the upper 16 bits of x's float32 pattern
// (sign, exponent and 7 mantissa bits: 65536 "buckets", each an interval of floats), then a short walk up.
// bucket_floor[k] = the largest j with code[j] <= the smallest float of bucket k (0 if none).  The smallest float
// of a bucket is its pattern with the low 16 bits 0 for a positive sign and all 1 for a negative sign (a larger
// pattern is a larger magnitude).  So for every x in the bucket, lo(x) >= bucket_floor[k], and walking up while
// code[lo + 1] <= x reaches lo(x) exactly: the same lo as a binary search, hence the same bytes as the contract.
// The walk is 0 or 1 steps for the dynamic maps (a bucket is 2^-7 of its magnitude wide, about as wide as their
// densest spacing); any strictly ascending code stays exact, only slower.  Buckets of NaN patterns hold 0, and
// the walk never moves a NaN (it compares false), as the contract wants.  Building the table is one merge of the
// 65536 bucket floors (ascending by value) with the 256 codes.
struct CodeBuckets {
  std::vector<uint8_t> floor_of;  // 65536 entries

  explicit CodeBuckets(const float* code) : floor_of(65536, 0) {
    // Ascending values: negative patterns from 0xFFFF down to 0x8000, then positive ones 0x0000 .. 0x7FFF.
    int j = 0;
    auto fill = [&](uint32_t k) {
      const uint32_t low = (k & 0x8000) ? 0xFFFFu : 0u;
      float smallest;
      const uint32_t bits = (k << 16) | low;
      std::memcpy(&smallest, &bits, sizeof smallest);
      if (smallest != smallest) return;  // a NaN bucket keeps 0
      while (j < 255 && code[j + 1] <= smallest) ++j;
      floor_of[k] = static_cast<uint8_t>(code[j] <= smallest ? j : 0);
    };
    for (uint32_t k = 0xFFFF; k >= 0x8000; --k) fill(k);
    for (uint32_t k = 0; k < 0x8000; ++k) fill(k);
  }

  uint8_t nearest(const float* code, float x) const {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    int lo = floor_of[bits >> 16];
    const int next = lo < 255 ? lo + 1 : 255;
    lo += next != lo && code[next] <= x;  // the usual single step, without a branch to mispredict
    while (lo < 255 && code[lo + 1] <= x) ++lo;  // codes denser than a bucket only
    const int hi = std::min(lo + 1, 255);
    return static_cast<uint8_t>(code[hi] - x < x - code[lo] ? hi : lo);
  }
};

// The tables of the last few codes seen (an optimizer quantizes with the same two maps every step, and building a
// table costs as much as quantizing 50,000 elements).  Looked up by the code's values; called with the GIL held.
static const CodeBuckets& buckets_for(const float* code) {
  struct Entry {
    std::vector<float> code;
    CodeBuckets buckets;
  };
  static std::vector<std::unique_ptr<Entry>> cache;  // most recently used first
  for (size_t k = 0; k < cache.size(); ++k) {
    if (std::equal(code, code + CODE_SIZE, cache[k]->code.begin())) {
      std::rotate(cache.begin(), cache.begin() + k, cache.begin() + k + 1);
      return cache.front()->buckets;
    }
  }
  if (cache.size() == 8) cache.pop_back();
  cache.insert(cache.begin(), std::make_unique<Entry>(Entry{std::vector<float>(code, code + CODE_SIZE),
                                                            CodeBuckets(code)}));
  return cache.front()->buckets;
}

// The largest |a[i]| of a[0..n); for a block holding a NaN, |first NaN| (a NaN, as numpy's max of abs gives).
static float block_absmax(const float* a, size_t n) {
  float m = 0.0f;
  bool nan = false;
  for (size_t i = 0; i < n; ++i) {
    const float v = std::fabs(a[i]);
    m = v > m ? v : m;
    nan |= v != v;
  }
  if (nan) {
    for (size_t i = 0;; ++i)
      if (a[i] != a[i]) return std::fabs(a[i]);
  }
  return m;
}

// One array a blockwise function takes: its name, the dtype it must have and the element count it must have.
struct BlockwiseArg {
  const char* name;
  const Array& array;
  DType dtype;
  size_t size;
};

// The checks of both functions after num_blocks has checked block_size, in the NumPy module's order: the dtypes
// (TypeError naming every array's dtype), then the sizes (ValueError naming the array, its size and the expected
// one).
static void check_blockwise(const char* fn, std::initializer_list<BlockwiseArg> args) {
  bool ok = true;
  for (const BlockwiseArg& x : args) ok = ok && x.array.dtype == x.dtype;
  if (!ok) {
    std::ostringstream want, got;
    for (const BlockwiseArg& x : args) {  // "expects float32 a, float32 code, ..., got a float16, code float32, ..."
      want << (want.tellp() > 0 ? ", " : "") << info(x.dtype).name << " " << x.name;
      got << (got.tellp() > 0 ? ", " : "") << x.name << " " << x.array.dtype_name();
    }
    throw py::type_error(std::string(fn) + ": expects " + want.str() + ", got " + got.str());
  }
  for (const BlockwiseArg& x : args) check_size(fn, x.name, x.array.size, x.size);
}

// ceil(n / block_size), after checking block_size >= 1 (ValueError).
static size_t num_blocks(const char* fn, size_t n, int64_t block_size) {
  if (block_size < 1)
    fail(std::string(fn) + ": block_size must be at least 1, got " + std::to_string(block_size));
  return n == 0 ? 0 : (n - 1) / static_cast<size_t>(block_size) + 1;
}

static void quantize_blockwise(const Array& a, const Array& code, Array& out, Array& absmax, int64_t block_size) {
  const char* fn = "quantize_blockwise";
  const size_t n = a.size, blocks = num_blocks(fn, n, block_size);
  check_blockwise(fn, {{"a", a, DType::f32, n},
                       {"code", code, DType::f32, CODE_SIZE},
                       {"out", out, DType::u8, n},
                       {"absmax", absmax, DType::f32, blocks}});
  const float* pa = a.data<float>();
  const float* pc = code.data<float>();
  uint8_t* po = out.data<uint8_t>();
  float* pm = absmax.data<float>();
  const size_t bs = static_cast<size_t>(block_size);
  const int nthreads = threads_for(n, true);
  const CodeBuckets& buckets = buckets_for(pc);
  py::gil_scoped_release release;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t b = 0; b < static_cast<int64_t>(blocks); ++b) {
    const size_t begin = static_cast<size_t>(b) * bs, end = std::min(n, begin + bs);
    const float m = block_absmax(pa + begin, end - begin);
    pm[b] = m;
    float x[256];  // the block's x = a / absmax, a chunk at a time: the division vectorizes, the lookups don't
    for (size_t i = begin; i < end; i += 256) {
      const size_t len = std::min<size_t>(256, end - i);
      for (size_t k = 0; k < len; ++k) x[k] = m == 0.0f ? 0.0f : pa[i + k] / m;
      for (size_t k = 0; k < len; ++k) po[i + k] = buckets.nearest(pc, x[k]);
    }
  }
}

static void dequantize_blockwise(const Array& q, const Array& code, const Array& absmax, Array& out,
                                 int64_t block_size) {
  const char* fn = "dequantize_blockwise";
  const size_t n = q.size, blocks = num_blocks(fn, n, block_size);
  check_blockwise(fn, {{"q", q, DType::u8, n},
                       {"code", code, DType::f32, CODE_SIZE},
                       {"absmax", absmax, DType::f32, blocks},
                       {"out", out, DType::f32, n}});
  const uint8_t* pq = q.data<uint8_t>();
  const float* pc = code.data<float>();
  const float* pm = absmax.data<float>();
  float* po = out.data<float>();
  const size_t bs = static_cast<size_t>(block_size);
  const int nthreads = threads_for(n, false);
  py::gil_scoped_release release;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t b = 0; b < static_cast<int64_t>(blocks); ++b) {
    const size_t begin = static_cast<size_t>(b) * bs, end = std::min(n, begin + bs);
    const float m = pm[b];
    for (size_t i = begin; i < end; ++i) po[i] = pc[pq[i]] * m;
  }
}


// ---- Adam, fused ------------------------------------------------------------------------------------------
//
// Both Adam kernels compute in float32 with every operation rounded (no fused multiply-add), so their bytes equal
// the NumPy reference's and the element-wise composite's.
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

// adam_step: Adam's update of one float32 parameter in one pass instead of eleven element-wise kernels (each a
// Python call and a full-size temporary).  Per element, in float32 with every operation rounded as the element-wise
// kernels round it (so the bytes equal the composite update's):
//   m = m * b1 + g * (1 - b1);  v = v * b2 + (g * g) * (1 - b2)
//   (first step: m = g * (1 - b1), v = (g * g) * (1 - b2))
//   out = theta - (m / c1) * lr / (sqrt(v / c2) + eps)
NEEDLE_NO_FMA static void adam_step(const Array& theta, const Array& grad, const Array& m, const Array& v, Array& out,
                                    Array& out_m, Array& out_v, bool first, double lr, double beta1, double beta2,
                                    double eps, double correction1, double correction2) {
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
  const float *pt = theta.data<float>(), *pg = grad.data<float>(), *pm = m.data<float>(), *pv = v.data<float>();
  float *po = out.data<float>(), *om = out_m.data<float>(), *ov = out_v.data<float>();
  const int nthreads = threads_for(n, true);
  py::gil_scoped_release release;
  // An OpenMP loop, not parallel_range's lambda: the region's body keeps this function's fp-contract=off.
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t i = 0; i < static_cast<int64_t>(n); ++i) {  // no branches but the loop-invariant one: vectorized
    const float g = pg[i];
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
                                        double eps, double correction1, double correction2) {
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
      for (size_t k = 0; k < len; ++k) {  // Adam (no lookups or branches: vectorized)
        const float mk = m[k] * b1 + g[k] * a1;
        const float vk = r[k] * r[k] * b2 + g[k] * g[k] * a2;
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

// ---- 3a. Vector math ----------------------------------------------------------------------------------------
//
// std::exp / std::log / std::tanh are scalar library calls, which no compiler vectorizes.  These are the
// Cephes single-precision algorithms (range reduction + a short polynomial; tanh with its own fits), rewritten
// without branches so one body serves 4, 8 or 16 lanes: special cases are computed for every lane and chosen
// with vector selects (`mask ? a : b`).  Measured against float64 references over their whole ranges, exp is
// within 1.01 ulp, log within 0.83 ulp and tanh within 1.10 ulp of the exact result (numpy's float32
// functions: 2.4, 3.8 and 1.4).
// Special values follow numpy: exp(-inf) = 0, exp(x > 88.72...) = inf, log(0) = -inf, log(x < 0) = NaN,
// tanh(+-inf) = +-1 exactly, NaN in -> NaN out; denormal inputs and results are handled, not flushed.
//
// Each function takes its argument by reference and overwrites it: passing 32- or 64-byte vectors by value
// from code not compiled for AVX would change the calling convention (GCC's -Wpsabi warning).

typedef scalar_t v4sf __attribute__((vector_size(16)));
typedef double v4df __attribute__((vector_size(32)));
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define NEEDLE_X86_DISPATCH 1
typedef scalar_t v8sf __attribute__((vector_size(32)));
typedef scalar_t v16sf __attribute__((vector_size(64)));
typedef double v8df __attribute__((vector_size(64)));
#ifdef NEEDLE_HAVE_IMMINTRIN
#define NEEDLE_BF16_DOT 1  // the bfloat16 dot-product matmul kernel (section 4)
#endif
#endif

// The int32 vector with as many lanes as F: the result type of F's comparisons and the type its bits are
// reinterpreted as (a cast between vector types of one size reinterprets the bits).
template <class F>
struct IntVec {
  typedef int32_t type __attribute__((vector_size(sizeof(F))));
};

#define NEEDLE_ALWAYS_INLINE inline __attribute__((always_inline))

// exp(x) for x in [-104, 89], finite: the core of ExpFn.
// exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2]; exp(r) by a degree-7 polynomial.
template <class F>
static NEEDLE_ALWAYS_INLINE void exp_in_range(F& x) {
  typedef typename IntVec<F>::type I;
  const F magic = F{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds |v| < 2^22 to an integer
  const F t = x * 1.44269504088896341f + magic;
  const F n = t - magic;                 // round(x / ln 2) as a float ...
  const I ni = (I)t - (I)magic;          // ... and as an int (the low mantissa bits of t)
  F r = x - n * 0.693359375f;            // ln 2 = 0.693359375 - 2.12194440e-4, the first part exact in
  r = r - n * -2.12194440e-4f;           // n * 0.693359375 (Cody-Waite)
  const F z = r * r;
  F y = F{} + 1.9875691500E-4f;
  y = y * r + 1.3981999507E-3f;
  y = y * r + 8.3334519073E-3f;
  y = y * r + 4.1665795894E-2f;
  y = y * r + 1.6666665459E-1f;
  y = y * r + 5.0000001201E-1f;
  y = y * z + r + 1.0f;
  // Times 2^n, built in the exponent field.  In two halves, so that n down to -150 (denormal results) and up
  // to 128 need no exponent outside [-126, 127]; only the last multiplication rounds.
  const I n1 = ni >> 1, n2 = ni - n1;
  x = y * (F)((n1 + 127) << 23) * (F)((n2 + 127) << 23);
}

struct ExpFn {
  template <class F>
  static NEEDLE_ALWAYS_INLINE void apply(F& x) {
    F xc = x < -104.0f ? F{} - 104.0f : x;  // exp(-104) rounds to 0, exp(89) to inf: outside, clamp
    xc = xc > 89.0f ? F{} + 89.0f : xc;
    exp_in_range(xc);
    xc = x > 88.72283935546875f ? F{} + __builtin_inff() : xc;
    x = x != x ? x : xc;  // NaN stays NaN
  }
};

struct LogFn {
  // log(x) = e ln 2 + log(1 + f), x = 2^e (1 + f) with 1 + f in [sqrt(1/2), sqrt(2)); log(1 + f) by a polynomial.
  template <class F>
  static NEEDLE_ALWAYS_INLINE void apply(F& x) {
    typedef typename IntVec<F>::type I;
    const I denormal = x < 1.17549435e-38f;        // scaled by 2^23 first, so the exponent field is exact
    const F xs = denormal ? x * 8388608.0f : x;
    const I bits = (I)xs;
    I e = ((bits >> 23) & 0xff) - (denormal ? I{} + (126 + 23) : I{} + 126);
    const F m = (F)((bits & 0x007fffff) | 0x3f000000);  // the mantissa as a float in [0.5, 1)
    const I low = m < 0.707106781186547524f;
    e = low ? e - 1 : e;
    const F f = low ? m + m - 1.0f : m - 1.0f;
    const F z = f * f;
    F y = F{} + 7.0376836292E-2f;
    y = y * f - 1.1514610310E-1f;
    y = y * f + 1.1676998740E-1f;
    y = y * f - 1.2420140846E-1f;
    y = y * f + 1.4249322787E-1f;
    y = y * f - 1.6668057665E-1f;
    y = y * f + 2.0000714765E-1f;
    y = y * f - 2.4999993993E-1f;
    y = y * f + 3.3333331174E-1f;
    y = y * f * z;
    const F fe = __builtin_convertvector(e, F);
    y = y + fe * -2.12194440e-4f;  // e ln 2 in two parts, as in ExpFn
    y = y - 0.5f * z;
    F result = f + y + fe * 0.693359375f;
    result = x == __builtin_inff() ? x : result;
    result = x == 0.0f ? F{} - __builtin_inff() : result;
    result = x < 0.0f ? F{} + __builtin_nanf("") : result;
    x = x != x ? x : result;
  }
};

struct TanhFn {
  // With z = |x|, two formulas are computed for every lane and one is chosen:
  //   z < 0.7:  an odd polynomial z + z^3 P(z^2) (a minimax fit on [0, 0.7]);
  //   z >= 0.7: 1 - 2 / (exp(2z) + 1).  There the result is above 0.6 and 2 / (exp(2z) + 1) below 0.4, so the
  //             subtraction loses little and the error of exp is damped: a degree-6 polynomial is enough, and
  //             2^n fits one exponent field, as z is clamped to 9.1 (the result rounds to exactly 1 from
  //             z = 9.011 on; the clamp also sends +-inf to +-1).  This is cheaper than calling exp_in_range.
  // The sign is copied from x: tanh(-0) = -0.  NaN fails both comparisons, so it takes the polynomial and stays NaN.
  template <class F>
  static NEEDLE_ALWAYS_INLINE void apply(F& x) {
    typedef typename IntVec<F>::type I;
    typedef uint32_t U __attribute__((vector_size(sizeof(F))));
    const F z = (F)((I)x & 0x7fffffff);  // |x|
    const F s = z * z;
    F p = F{} - 5.13865891844e-3f;
    p = p * s + 2.00919657946e-2f;
    p = p * s - 5.35588599741e-2f;
    p = p * s + 1.33291110396e-1f;
    p = p * s - 3.33331912756e-1f;
    const F small = p * s * z + z;
    const F zc = z < 9.1f ? z : F{} + 9.1f;
    // exp(2 zc) = 2^n exp(2r) with n = round(2 zc / ln 2) and r = zc - n ln2/2 in [-ln2/4, ln2/4], as in
    // exp_in_range, but with 1.5 * 2^23 + 127 as the magic number: the low 9 bits of t then hold n + 127, the
    // biased exponent of 2^n, so t << 23 is 2^n.  ln2/2 = 0.3466796875 - 1.06097220e-4 (Cody-Waite).
    const F magic = F{} + 12583039.0f;
    const F t = zc * 2.88539008177792681f + magic;
    const F n = t - magic;
    F r = zc - n * 0.3466796875f;
    r = r - n * -1.06097220e-4f;
    F e = F{} + 8.843709528e-2f;  // exp(2r) by a minimax polynomial
    e = e * r + 2.677930295e-1f;
    e = e * r + 6.666926742e-1f;
    e = e * r + 1.333321810f;
    e = e * r + 1.999999762f;
    e = e * r + 2.0f;
    e = e * r + 1.0f;
    e = e * (F)((U)t << 23) + 1.0f;  // exp(2 zc) + 1
    const F large = 1.0f - 2.0f / e;
    const F result = z >= 0.7f ? large : small;
    x = (F)((I)result | ((I)x & (int32_t)0x80000000));
  }
};

// out[i] = OP(a[i]) for i < n, W lanes at a time; the last n % W elements go through a zero-padded vector, so
// every element gets exactly the same arithmetic.  a may be out (in place).
template <class F, class OP>
static NEEDLE_ALWAYS_INLINE void map_run(const scalar_t* a, scalar_t* out, int64_t n) {
  constexpr int64_t W = sizeof(F) / sizeof(scalar_t);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    F x;
    __builtin_memcpy(&x, a + i, sizeof(F));
    OP::apply(x);
    __builtin_memcpy(out + i, &x, sizeof(F));
  }
  if (i < n) {
    F x = {};
    __builtin_memcpy(&x, a + i, static_cast<size_t>(n - i) * ELEM_SIZE);
    OP::apply(x);
    __builtin_memcpy(out + i, &x, static_cast<size_t>(n - i) * ELEM_SIZE);
  }
}

// Sum of a[0..n) accumulated in double, as numpy's float32 sum is not, but accurately enough that the order
// matters little: FH (floats) are widened to D (doubles with as many lanes) in four independent accumulators.
template <class FH, class D>
static NEEDLE_ALWAYS_INLINE double sum_run(const scalar_t* a, int64_t n) {
  constexpr int64_t W = sizeof(FH) / sizeof(scalar_t);
  D acc[4] = {};
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      FH x;
      __builtin_memcpy(&x, a + i + u * W, sizeof(FH));
      acc[u] += __builtin_convertvector(x, D);
    }
  }
  for (; i + W <= n; i += W) {
    FH x;
    __builtin_memcpy(&x, a + i, sizeof(FH));
    acc[0] += __builtin_convertvector(x, D);
  }
  const D total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  double s = 0.0;
  for (int64_t l = 0; l < W; ++l) s += total[l];
  for (; i < n; ++i) s += a[i];
  return s;
}

// Maximum of a[0..n), n >= 1; NaN if any element is NaN (as numpy's max).  Four accumulators of W lanes; the
// last partial vector is read overlapping the previous one (taking a maximum twice changes nothing).  NaNs
// are remembered by a select into `nan` rather than by OR-ing comparison results: AVX-512 comparisons give
// mask registers, which selects use directly but turning them into a vector of ints needs AVX512DQ.
template <class F>
static NEEDLE_ALWAYS_INLINE scalar_t max_run(const scalar_t* a, int64_t n) {
  constexpr int64_t W = sizeof(F) / sizeof(scalar_t);
  if (n < W) {
    scalar_t m = a[0];
    bool nan = false;
    for (int64_t i = 0; i < n; ++i) {
      m = a[i] > m ? a[i] : m;
      nan |= a[i] != a[i];
    }
    return nan ? std::numeric_limits<scalar_t>::quiet_NaN() : m;
  }
  F acc[4];
  __builtin_memcpy(&acc[0], a, sizeof(F));
  acc[1] = acc[2] = acc[3] = acc[0];
  F nan = {};  // a lane becomes NaN once a NaN passed through it
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      F x;
      __builtin_memcpy(&x, a + i + u * W, sizeof(F));
      nan = x != x ? x : nan;
      acc[u] = x > acc[u] ? x : acc[u];
    }
  }
  for (; i < n; i += W) {
    F x;
    __builtin_memcpy(&x, a + std::min(i, n - W), sizeof(F));
    nan = x != x ? x : nan;
    acc[0] = x > acc[0] ? x : acc[0];
  }
  acc[0] = acc[1] > acc[0] ? acc[1] : acc[0];
  acc[2] = acc[3] > acc[2] ? acc[3] : acc[2];
  acc[0] = acc[2] > acc[0] ? acc[2] : acc[0];
  scalar_t m = acc[0][0];
  bool any_nan = false;
  for (int64_t l = 0; l < W; ++l) {
    m = acc[0][l] > m ? acc[0][l] : m;
    any_nan |= nan[l] != nan[l];
  }
  return any_nan ? std::numeric_limits<scalar_t>::quiet_NaN() : m;
}

// Σ exp(a[i] - m) for i < n (m = the row's maximum, so every term is in [0, 1]): the exp of ExpFn on W lanes at a
// time, four float accumulators (at most n / 4W terms each), summed in double at the end.  The last partial
// vector is padded with -inf, whose exp is 0.
template <class F>
static NEEDLE_ALWAYS_INLINE double sum_exp_run(const scalar_t* a, int64_t n, scalar_t m) {
  constexpr int64_t W = sizeof(F) / sizeof(scalar_t);
  F acc[4] = {};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    F x;
    __builtin_memcpy(&x, a + i, sizeof(F));
    x = x - m;
    ExpFn::apply(x);
    acc[(i / W) & 3] += x;
  }
  if (i < n) {
    F x = F{} - __builtin_inff();
    __builtin_memcpy(&x, a + i, static_cast<size_t>(n - i) * ELEM_SIZE);
    x = x - m;
    ExpFn::apply(x);
    acc[0] += x;
  }
  double s = 0.0;
  for (int u = 0; u < 4; ++u)
    for (int64_t l = 0; l < W; ++l) s += acc[u][l];
  return s;
}

// One set of the kernels above per instruction set: the same template bodies instantiated inside functions
// compiled for AVX-512 (16 lanes), AVX2 + FMA (8 lanes) or the baseline (4 lanes, SSE2 on x86-64) with
// per-function `target` attributes, as the matmul micro-kernels are (section 4).  The widest set the CPU
// supports is chosen at import.  With FMA the polynomials round slightly differently, so the sets may differ in
// the last bit; each is deterministic.
struct VectorKernels {
  const char* name;
  void (*exp)(const scalar_t*, scalar_t*, int64_t);
  void (*log)(const scalar_t*, scalar_t*, int64_t);
  void (*tanh)(const scalar_t*, scalar_t*, int64_t);
  double (*sum)(const scalar_t*, int64_t);
  scalar_t (*max)(const scalar_t*, int64_t);
  double (*sum_exp)(const scalar_t*, int64_t, scalar_t);
};

#define NEEDLE_VECTOR_KERNELS(ISA, TARGET, F, FH, D)                                                         \
  TARGET static void exp_##ISA(const scalar_t* a, scalar_t* o, int64_t n) { map_run<F, ExpFn>(a, o, n); }   \
  TARGET static void log_##ISA(const scalar_t* a, scalar_t* o, int64_t n) { map_run<F, LogFn>(a, o, n); }   \
  TARGET static void tanh_##ISA(const scalar_t* a, scalar_t* o, int64_t n) { map_run<F, TanhFn>(a, o, n); } \
  TARGET static double sum_##ISA(const scalar_t* a, int64_t n) { return sum_run<FH, D>(a, n); }             \
  TARGET static scalar_t max_##ISA(const scalar_t* a, int64_t n) { return max_run<F>(a, n); }               \
  TARGET static double sum_exp_##ISA(const scalar_t* a, int64_t n, scalar_t m) {                            \
    return sum_exp_run<F>(a, n, m);                                                                         \
  }                                                                                                         \
  static const VectorKernels VECTOR_##ISA = {#ISA,      exp_##ISA, log_##ISA, tanh_##ISA,                   \
                                             sum_##ISA, max_##ISA, sum_exp_##ISA};

NEEDLE_VECTOR_KERNELS(generic, , v4sf, v4sf, v4df)
#ifdef NEEDLE_X86_DISPATCH
NEEDLE_VECTOR_KERNELS(avx2, __attribute__((target("avx2,fma"))), v8sf, v4sf, v4df)
NEEDLE_VECTOR_KERNELS(avx512, __attribute__((target("avx512f,avx512vl,avx2,fma"))), v16sf, v8sf, v8df)
#endif

// Whether this CPU (and OS) runs code for the instruction set `name`: avx512, avx2 or generic.
static bool cpu_has(const char* name) {
#ifdef NEEDLE_X86_DISPATCH
  __builtin_cpu_init();
  if (std::strcmp(name, "avx512") == 0) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  if (std::strcmp(name, "avx2") == 0) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return std::strcmp(name, "generic") == 0;
}

static const VectorKernels* vector_kernels_by_name(const std::string& name) {
  if (!cpu_has(name.c_str())) return nullptr;
#ifdef NEEDLE_X86_DISPATCH
  if (name == "avx512") return &VECTOR_avx512;
  if (name == "avx2") return &VECTOR_avx2;
#endif
  return &VECTOR_generic;
}

static const VectorKernels* g_vector = &VECTOR_generic;  // the widest supported set, chosen at import

static void choose_vector_kernels() {
  for (const char* name : {"avx512", "avx2", "generic"}) {
    const VectorKernels* k = vector_kernels_by_name(name);
    if (k != nullptr) {
      g_vector = k;
      return;
    }
  }
}

static void set_vector_isa(const std::string& name) {
  const VectorKernels* k = vector_kernels_by_name(name);
  if (k == nullptr) fail("set_vector_isa: '" + name + "' is unknown or not supported by this CPU");
  g_vector = k;
}

// ---- 3b. Element-wise ops on compact buffers -----------------------------------------------------------------
// Plain loops; with -O3 GCC vectorizes the cheap ones (out may be the same buffer as an input, so there is no
// __restrict: GCC adds a runtime overlap check).

static inline scalar_t max_nan(scalar_t x, scalar_t y) { return (x > y || x != x) ? x : y; }

// The binary operations, shared by the compact (ewise_*, scalar_*) and strided (ewise_strided, scalar_strided)
// entry points.  `expensive` ones get threads from PARALLEL_TRANSCENDENTAL elements on.
struct AddOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t y) const { return x + y; }
};
struct SubOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t y) const { return x - y; }
};
struct MulOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t y) const { return x * y; }
};
struct DivOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t y) const { return x / y; }
};
struct PowerOp {
  static constexpr bool expensive = true;
  scalar_t operator()(scalar_t x, scalar_t y) const { return std::pow(x, y); }
};
struct MaximumOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t y) const { return max_nan(x, y); }
};
struct EqOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t y) const { return scalar_t(x == y); }
};
struct GeOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t y) const { return scalar_t(x >= y); }
};
struct GtOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t y) const { return scalar_t(x > y); }
};

// Written once over the storage type: load as float, compute, round on store (the identity for float32).
template <class Op>
static void ewise_binary(const char* fn, const Array& a, const Array& b, Array& out, Op f) {
  check_size(fn, "b", b.size, a.size);
  check_size(fn, "out", out.size, a.size);
  visit_float(same_float_dtype(fn, {&a, &b, &out}), [&](auto t) {
    using T = decltype(t);
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* po = out.data<T>();
    parallel_range(a.size, threads_for(a.size, Op::expensive), [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) po[i] = from_float<T>(f(to_float(pa[i]), to_float(pb[i])));
    });
  });
}

template <class Op>
static void scalar_binary(const char* fn, const Array& a, scalar_t val, Array& out, Op f) {
  check_size(fn, "out", out.size, a.size);
  visit_float(same_float_dtype(fn, {&a, &out}), [&](auto t) {
    using T = decltype(t);
    const T* pa = a.data<T>();
    T* po = out.data<T>();
    parallel_range(a.size, threads_for(a.size, Op::expensive), [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) po[i] = from_float<T>(f(to_float(pa[i]), val));
    });
  });
}

// The float32 vector kernels (exp, log, tanh) on 16-bit data: blocks of BLOCK elements are widened into a float
// buffer on the stack, mapped there and rounded back, so the kernels stay the float32 ones.
constexpr size_t BLOCK = 256;

template <class T, class K>
static void in_float_blocks(const T* in, T* out, size_t n, K kernel) {
  float buf[BLOCK];
  for (size_t b = 0; b < n; b += BLOCK) {
    const size_t len = std::min(BLOCK, n - b);
    for (size_t j = 0; j < len; ++j) buf[j] = to_float(in[b + j]);
    kernel(buf, buf, static_cast<int64_t>(len));
    for (size_t j = 0; j < len; ++j) out[b + j] = from_float<T>(buf[j]);
  }
}

static void ewise_add(const Array& a, const Array& b, Array& out) { ewise_binary("ewise_add", a, b, out, AddOp()); }
static void ewise_mul(const Array& a, const Array& b, Array& out) { ewise_binary("ewise_mul", a, b, out, MulOp()); }
static void ewise_div(const Array& a, const Array& b, Array& out) { ewise_binary("ewise_div", a, b, out, DivOp()); }
static void ewise_maximum(const Array& a, const Array& b, Array& out) {
  ewise_binary("ewise_maximum", a, b, out, MaximumOp());
}
static void ewise_eq(const Array& a, const Array& b, Array& out) { ewise_binary("ewise_eq", a, b, out, EqOp()); }
static void ewise_ge(const Array& a, const Array& b, Array& out) { ewise_binary("ewise_ge", a, b, out, GeOp()); }
static void ewise_gt(const Array& a, const Array& b, Array& out) { ewise_binary("ewise_gt", a, b, out, GtOp()); }
static void ewise_power(const Array& a, const Array& b, Array& out) {
  ewise_binary("ewise_power", a, b, out, PowerOp());
}

static void scalar_add(const Array& a, scalar_t val, Array& out) { scalar_binary("scalar_add", a, val, out, AddOp()); }
static void scalar_mul(const Array& a, scalar_t val, Array& out) { scalar_binary("scalar_mul", a, val, out, MulOp()); }
static void scalar_div(const Array& a, scalar_t val, Array& out) { scalar_binary("scalar_div", a, val, out, DivOp()); }
static void scalar_maximum(const Array& a, scalar_t val, Array& out) {
  scalar_binary("scalar_maximum", a, val, out, MaximumOp());
}
static void scalar_eq(const Array& a, scalar_t val, Array& out) { scalar_binary("scalar_eq", a, val, out, EqOp()); }
static void scalar_ge(const Array& a, scalar_t val, Array& out) { scalar_binary("scalar_ge", a, val, out, GeOp()); }
static void scalar_gt(const Array& a, scalar_t val, Array& out) { scalar_binary("scalar_gt", a, val, out, GtOp()); }

// x^2 and x^1 are common (squared errors) and need no pow call.
struct SquareOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t) const { return x * x; }
};
struct FirstOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t) const { return x; }
};
// x^0.5 (Adam's denominator, norms) is a square root, as NumPy computes it (so -0 gives -0 and -inf NaN):
// correctly rounded and vectorizable, where a vectorized pow may be an ulp off.
struct SqrtOp {
  static constexpr bool expensive = false;
  scalar_t operator()(scalar_t x, scalar_t) const { return std::sqrt(x); }
};
static void scalar_power(const Array& a, scalar_t val, Array& out) {
  if (val == 0.5f) {
    scalar_binary("scalar_power", a, val, out, SqrtOp());
  } else if (val == 2.0f) {
    scalar_binary("scalar_power", a, val, out, SquareOp());
  } else if (val == 1.0f) {
    scalar_binary("scalar_power", a, val, out, FirstOp());
  } else {
    scalar_binary("scalar_power", a, val, out, PowerOp());
  }
}

typedef void (*vector_fn)(const scalar_t*, scalar_t*, int64_t);

static void ewise_vector(const char* fn, const Array& a, Array& out, vector_fn kernel) {
  check_size(fn, "out", out.size, a.size);
  visit_float(same_float_dtype(fn, {&a, &out}), [&](auto t) {
    using T = decltype(t);
    const T* pa = a.data<T>();
    T* po = out.data<T>();
    parallel_range(a.size, threads_for(a.size, true), [&](size_t begin, size_t end) {
      if constexpr (std::is_same<T, float>::value) {
        kernel(pa + begin, po + begin, static_cast<int64_t>(end - begin));
      } else {
        in_float_blocks(pa + begin, po + begin, end - begin, kernel);
      }
    });
  });
}

static void ewise_log(const Array& a, Array& out) { ewise_vector("ewise_log", a, out, g_vector->log); }
static void ewise_exp(const Array& a, Array& out) { ewise_vector("ewise_exp", a, out, g_vector->exp); }
static void ewise_tanh(const Array& a, Array& out) { ewise_vector("ewise_tanh", a, out, g_vector->tanh); }

// ---- 3c. Element-wise ops on strided views -------------------------------------------------------------------
//
// out (compact, `shape`) = op(a view, b view) without compacting either view: a Walk over the two operands
// (section 2) hands each run to binary_run, whose inner loop is specialised for the stride pairs that occur in
// practice: (1, 1) both contiguous, (1, 0) / (0, 1) one side broadcast along the run (a row vector or a
// scalar: the Z - broadcast(lse) of a softmax), and anything else (transposed views) element by element.
// out must not share a buffer with a or b (checked), so the loops may use __restrict.

template <class Op>
static inline void binary_run(const scalar_t* __restrict a, int64_t sa, const scalar_t* __restrict b, int64_t sb,
                              scalar_t* __restrict out, int64_t n, Op f) {
  if (sa == 1 && sb == 1) {
    for (int64_t j = 0; j < n; ++j) out[j] = f(a[j], b[j]);
  } else if (sa == 1 && sb == 0) {
    const scalar_t y = *b;
    for (int64_t j = 0; j < n; ++j) out[j] = f(a[j], y);
  } else if (sa == 0 && sb == 1) {
    const scalar_t x = *a;
    for (int64_t j = 0; j < n; ++j) out[j] = f(x, b[j]);
  } else {
    for (int64_t j = 0; j < n; ++j) out[j] = f(a[j * sa], b[j * sb]);
  }
}

// Calls visit(op) with the functor of the binary operation named `name`.
template <class V>
static void with_binary_op(const char* fn, const std::string& name, V visit) {
  if (name == "add") return visit(AddOp());
  if (name == "sub") return visit(SubOp());
  if (name == "mul") return visit(MulOp());
  if (name == "div") return visit(DivOp());
  if (name == "power") return visit(PowerOp());
  if (name == "maximum") return visit(MaximumOp());
  if (name == "eq") return visit(EqOp());
  if (name == "ge") return visit(GeOp());
  if (name == "gt") return visit(GtOp());
  fail(std::string(fn) + ": unknown op '" + name + "' (expected add, sub, mul, div, power, maximum, eq, ge or gt)");
}

static void check_out(const char* fn, const Array& out, size_t size, const Array* inputs[], int count) {
  check_size(fn, "out", out.size, size);
  for (int k = 0; k < count; ++k)
    if (out.size != 0 && out.ptr == inputs[k]->ptr) fail(std::string(fn) + ": out must not be one of the inputs");
}

// out[i] = op(a[a view element i], b[b view element i]); operand 0 of the walk is a, operand 1 is b.
static void strided_binary(const char* fn, const std::string& op, const scalar_t* a, const scalar_t* b,
                           const Walk<2>& w, Array& out) {
  scalar_t* po = out.ptr;
  with_binary_op(fn, op, [&](auto f) {
    for_each_run(w, threads_for(w.size, decltype(f)::expensive),
                 [&](const int64_t* pos, size_t i, int64_t len, const int64_t* step) {
                   binary_run(a + pos[0], step[0], b + pos[1], step[1], po + i, len, f);
                 });
  });
}

static void ewise_strided(const std::string& op, const Array& a, const std::vector<int64_t>& a_strides,
                          int64_t a_offset, const Array& b, const std::vector<int64_t>& b_strides, int64_t b_offset,
                          Array& out, const std::vector<int64_t>& shape) {
  const Operand ops[2] = {{"a", &a_strides, a_offset, a.size}, {"b", &b_strides, b_offset, b.size}};
  require_float32("ewise_strided", {&a, &b, &out});
  const Walk<2> w = make_walk("ewise_strided", shape, ops);
  const Array* inputs[] = {&a, &b};
  check_out("ewise_strided", out, w.size, inputs, 2);
  strided_binary("ewise_strided", op, a.ptr, b.ptr, w, out);
}

// The scalar is operand b of the same walk: one element with stride 0 along every dimension.
static void scalar_strided(const std::string& op, const Array& a, const std::vector<int64_t>& strides,
                           int64_t offset, scalar_t val, Array& out, const std::vector<int64_t>& shape) {
  const std::vector<int64_t> zeros(shape.size(), 0);
  const Operand ops[2] = {{"a", &strides, offset, a.size}, {"val", &zeros, 0, 1}};
  require_float32("scalar_strided", {&a, &out});
  const Walk<2> w = make_walk("scalar_strided", shape, ops);
  const Array* inputs[] = {&a};
  check_out("scalar_strided", out, w.size, inputs, 1);
  strided_binary("scalar_strided", op, a.ptr, &val, w, out);
}

// out[i] = f(a[view element i]) for f in log, exp, tanh: each run is mapped straight from a when it is
// contiguous, otherwise first gathered into its place in out and mapped there.
static void unary_strided(const std::string& op, const Array& a, const std::vector<int64_t>& strides,
                          int64_t offset, Array& out, const std::vector<int64_t>& shape) {
  vector_fn kernel = op == "log" ? g_vector->log : op == "exp" ? g_vector->exp : op == "tanh" ? g_vector->tanh
                                                                                              : nullptr;
  if (kernel == nullptr) fail("unary_strided: unknown op '" + op + "' (expected log, exp or tanh)");
  require_float32("unary_strided", {&a, &out});
  const Walk<1> w = make_view("unary_strided", shape, strides, offset, a.size);
  const Array* inputs[] = {&a};
  check_out("unary_strided", out, w.size, inputs, 1);
  const scalar_t* pa = a.ptr;
  scalar_t* po = out.ptr;
  for_each_run(w, threads_for(w.size, true), [&](const int64_t* pos, size_t i, int64_t len, const int64_t* step) {
    if (step[0] == 1) {
      kernel(pa + pos[0], po + i, len);
    } else {
      for (int64_t j = 0; j < len; ++j) po[i + j] = pa[pos[0] + j * step[0]];
      kernel(po + i, po + i, len);
    }
  });
}

// ---- 3d. Reductions, gathers and scatters --------------------------------------------------------------------

static void check_reduce(const char* fn, const Array& a, const Array& out, int64_t reduce_size) {
  if (reduce_size < 0) fail(std::string(fn) + ": reduce_size must be >= 0");
  if (static_cast<size_t>(reduce_size) * out.size != a.size) {
    std::ostringstream msg;
    msg << fn << ": a has " << a.size << " elements, expected out.size * reduce_size = " << out.size << " * "
        << reduce_size;
    fail(msg.str());
  }
}

// A 16-bit row widened into the calling thread's float buffer (float32 rows are used in place).
template <class T>
static const float* row_as_float(const T* row, size_t n) {
  if constexpr (std::is_same<T, float>::value) {
    return row;
  } else {
    static thread_local std::vector<float> buf;
    if (buf.size() < n) buf.resize(n);
    for (size_t j = 0; j < n; ++j) buf[j] = to_float(row[j]);
    return buf.data();
  }
}

// Rows are independent: split over threads once there is enough to read.
static void reduce_rows(const char* fn, const Array& a, Array& out, size_t r, scalar_t (*row_fn)(const scalar_t*, int64_t),
                        int nthreads) {
  visit_float(same_float_dtype(fn, {&a, &out}), [&](auto t) {
    using T = decltype(t);
    const T* pa = a.data<T>();
    T* po = out.data<T>();
    parallel_range(out.size, nthreads, [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i)
        po[i] = from_float<T>(row_fn(row_as_float(pa + i * r, r), static_cast<int64_t>(r)));
    });
  });
}

static scalar_t row_sum(const scalar_t* row, int64_t n) { return static_cast<scalar_t>(g_vector->sum(row, n)); }
static scalar_t row_max(const scalar_t* row, int64_t n) { return g_vector->max(row, n); }

// Sums accumulate in double (sum_run): more accurate than a float chain.
static void reduce_sum(const Array& a, Array& out, int64_t reduce_size) {
  check_reduce("reduce_sum", a, out, reduce_size);
  reduce_rows("reduce_sum", a, out, static_cast<size_t>(reduce_size), row_sum,
              a.size >= PARALLEL_CHEAP / 4 ? num_threads() : 1);
}

// Max of each row; a NaN anywhere in a row gives NaN, as numpy's max does.
static void reduce_max(const Array& a, Array& out, int64_t reduce_size) {
  check_reduce("reduce_max", a, out, reduce_size);
  if (reduce_size == 0 && out.size != 0) fail("reduce_max: cannot reduce over zero elements");
  reduce_rows("reduce_max", a, out, static_cast<size_t>(reduce_size), row_max,
              a.size >= PARALLEL_CHEAP / 4 ? num_threads() : 1);
}

// Converts every idx value to a row (or column) number, raising IndexError (before anything is written) for a
// value that is not an integer or not in [0, rows).
static std::vector<size_t> check_indices(const char* fn, const Array& idx, size_t rows) {
  std::vector<double> values(idx.size);  // double holds every int32 exactly
  visit_any(idx.dtype, [&](auto t) {
    using T = decltype(t);
    for (size_t i = 0; i < idx.size; ++i) {
      if constexpr (std::is_integral<T>::value) {
        values[i] = static_cast<double>(idx.data<T>()[i]);
      } else {
        values[i] = to_float(idx.data<T>()[i]);
      }
    }
  });
  std::vector<size_t> out(idx.size);
  for (size_t i = 0; i < idx.size; ++i) {
    const double v = values[i];
    const bool integer = std::isfinite(v) && v == std::floor(v);
    if (!integer || v < 0.0 || v >= static_cast<double>(rows)) {
      std::ostringstream msg;
      msg << fn << ": index " << v << (integer ? " is out of range for " : " is not an integer, for ") << rows
          << " rows";
      throw py::index_error(msg.str());
    }
    out[i] = static_cast<size_t>(v);
  }
  return out;
}

static void check_row_size(const char* fn, int64_t row_size, const Array& table) {
  if (row_size <= 0) fail(std::string(fn) + ": row_size must be positive");
  if (table.size % static_cast<size_t>(row_size) != 0) {
    std::ostringstream msg;
    msg << fn << ": a buffer of " << table.size << " elements is not a whole number of rows of " << row_size;
    fail(msg.str());
  }
}

// out[i, :] = a[idx[i], :]
static void take_rows(const Array& a, const Array& idx, Array& out, int64_t row_size) {
  check_row_size("take_rows", row_size, a);
  const size_t r = static_cast<size_t>(row_size);
  check_size("take_rows", "out", out.size, idx.size * r);
  if (a.dtype != out.dtype)
    throw py::type_error("take_rows: a is " + a.dtype_name() + " but out is " + out.dtype_name());
  std::vector<size_t> rows = check_indices("take_rows", idx, a.size / r);
  const char* src = reinterpret_cast<const char*>(a.ptr);
  char* dst = reinterpret_cast<char*>(out.ptr);
  const size_t row_bytes = r * a.itemsize;
  for (size_t i = 0; i < rows.size(); ++i) std::memcpy(dst + i * row_bytes, src + rows[i] * row_bytes, row_bytes);
}

// out[idx[i], :] += src[i, :], in order of i
static void scatter_add_rows(const Array& src, const Array& idx, Array& out, int64_t row_size) {
  check_row_size("scatter_add_rows", row_size, out);
  const size_t r = static_cast<size_t>(row_size);
  check_size("scatter_add_rows", "src", src.size, idx.size * r);
  const DType dt = same_float_dtype("scatter_add_rows", {&src, &out});
  std::vector<size_t> rows = check_indices("scatter_add_rows", idx, out.size / r);
  visit_float(dt, [&](auto t) {
    using T = decltype(t);
    for (size_t i = 0; i < rows.size(); ++i) {
      T* dst = out.data<T>() + rows[i] * r;
      const T* s = src.data<T>() + i * r;
      for (size_t j = 0; j < r; ++j) dst[j] = from_float<T>(to_float(dst[j]) + to_float(s[j]));
    }
  });
}

// out[i] = a[i, idx[i]], a viewed as (idx.size, row_size)
static void take_along_rows(const Array& a, const Array& idx, Array& out, int64_t row_size) {
  if (row_size < 0) fail("take_along_rows: row_size must be >= 0");
  const size_t r = static_cast<size_t>(row_size);
  check_size("take_along_rows", "a", a.size, idx.size * r);
  check_size("take_along_rows", "out", out.size, idx.size);
  const DType dt = same_float_dtype("take_along_rows", {&a, &out});
  std::vector<size_t> cols = check_indices("take_along_rows", idx, r);
  visit_float(dt, [&](auto t) {
    using T = decltype(t);
    for (size_t i = 0; i < cols.size(); ++i) out.data<T>()[i] = a.data<T>()[i * r + cols[i]];
  });
}

// out[i, idx[i]] += src[i], out viewed as (idx.size, row_size)
static void scatter_along_rows(const Array& src, const Array& idx, Array& out, int64_t row_size) {
  if (row_size < 0) fail("scatter_along_rows: row_size must be >= 0");
  const size_t r = static_cast<size_t>(row_size);
  check_size("scatter_along_rows", "src", src.size, idx.size);
  check_size("scatter_along_rows", "out", out.size, idx.size * r);
  const DType dt = same_float_dtype("scatter_along_rows", {&src, &out});
  std::vector<size_t> cols = check_indices("scatter_along_rows", idx, r);
  visit_float(dt, [&](auto t) {
    using T = decltype(t);
    for (size_t i = 0; i < cols.size(); ++i) {
      T& o = out.data<T>()[i * r + cols[i]];
      o = from_float<T>(to_float(o) + to_float(src.data<T>()[i]));
    }
  });
}

// log Σ_j exp(a[i, j]) of each row, max-shifted: m + log Σ exp(a - m), so exp never overflows.  A row whose
// maximum is not finite gives that maximum (+inf, -inf for a row of -inf) or NaN.
static scalar_t row_logsumexp(const scalar_t* row, int64_t n) {
  const scalar_t m = g_vector->max(row, n);
  if (!std::isfinite(m)) return m;
  return m + static_cast<scalar_t>(std::log(g_vector->sum_exp(row, n, m)));
}

static void reduce_logsumexp(const Array& a, Array& out, int64_t reduce_size) {
  check_reduce("reduce_logsumexp", a, out, reduce_size);
  if (reduce_size == 0 && out.size != 0) fail("reduce_logsumexp: cannot reduce over zero elements");
  reduce_rows("reduce_logsumexp", a, out, static_cast<size_t>(reduce_size), row_logsumexp,
              threads_for(a.size, true));
}

// The gradient of the softmax cross-entropy loss_i = logsumexp(a[i]) - a[i, idx[i]] for an upstream g (one
// value per row): out[i, j] = g[i] * (softmax(a[i])_j - [j == idx[i]]).  Row by row, so the row stays in cache
// through the five sweeps (max, Σ exp, a - lse, exp, scale) and the logits are read from memory once, with no
// temporary array.
static void softmax_xent_grad(const Array& a, const Array& idx, const Array& g, Array& out, int64_t row_size) {
  if (row_size <= 0) fail("softmax_xent_grad: row_size must be positive");
  const size_t r = static_cast<size_t>(row_size);
  check_size("softmax_xent_grad", "a", a.size, idx.size * r);
  check_size("softmax_xent_grad", "g", g.size, idx.size);
  check_size("softmax_xent_grad", "out", out.size, idx.size * r);
  const DType dt = same_float_dtype("softmax_xent_grad", {&a, &g, &out});
  std::vector<size_t> cols = check_indices("softmax_xent_grad", idx, r);
  visit_float(dt, [&](auto t) {
    using T = decltype(t);
    parallel_range(idx.size, threads_for(a.size, true), [&](size_t begin, size_t end) {
      // float32 rows are computed in out itself; 16-bit ones in a float row buffer, rounded once at the end.
      std::vector<float> buf(std::is_same<T, float>::value ? 0 : r);
      for (size_t i = begin; i < end; ++i) {
        const float* row = row_as_float(a.data<T>() + i * r, r);
        float* o = std::is_same<T, float>::value ? reinterpret_cast<float*>(out.data<T>() + i * r) : buf.data();
        const scalar_t lse = row_logsumexp(row, row_size);
        for (size_t j = 0; j < r; ++j) o[j] = row[j] - lse;
        g_vector->exp(o, o, row_size);
        const scalar_t gi = to_float(g.data<T>()[i]);
        for (size_t j = 0; j < r; ++j) o[j] *= gi;
        o[cols[i]] -= gi;
        if constexpr (!std::is_same<T, float>::value)
          for (size_t j = 0; j < r; ++j) out.data<T>()[i * r + j] = from_float<T>(o[j]);
      }
    });
  });
}

// ------------------------------------------------------------------------------------------------------------
// 4. Matrix multiplication
// ------------------------------------------------------------------------------------------------------------
//
// C (m x p) = A (m x n) @ B (n x p).  The classic Goto/BLIS scheme:
//
//   for jc in [0, p) step NC                      columns of C and B  (B block KC x NC lives in L3/L2)
//     for pc in [0, n) step KC                    the shared dimension
//       pack B[pc:pc+KC, jc:jc+NC] into micro-panels of NR columns:   Bp[panel][k][0..NR)   (all threads)
//       for ic in [0, m) step MC      (OpenMP)    row blocks of C and A, one thread each
//         pack A[ic:ic+MC, pc:pc+KC] into micro-panels of MR rows:    Ap[panel][k][0..MR)   (thread-local)
//         for jr in [0, NC) step NR               one B micro-panel (KC x NR) stays in L1 ...
//           for ir in [0, MC) step MR             ... while the A micro-panels stream from L2
//             micro-kernel: C[ir:ir+MR, jr:jr+NR] (+)= Ap[ir] @ Bp[jr]  (MR x NR sums held in registers)
//
// Packing copies each operand once per block into the exact order the micro-kernel reads it (unit stride,
// zero-padded to whole MR / NR panels, so the micro-kernel never branches on edges in its k loop).  The first
// KC block stores into C, later ones accumulate.  Threads (OpenMP, OMP_NUM_THREADS) pack the shared B block
// together and then take row blocks (about 4 per thread, so small m still splits evenly); the only
// synchronisation is the two barriers around each B block.  Every element of C is produced by one thread with
// the same order of additions, so results do not depend on the thread count.
//
// The micro-kernel keeps an MR x NR tile of C in vector registers (GCC vector extensions, no intrinsics): per k
// it loads NR/VL vectors of B and, for each of the MR rows, broadcasts one A value and does NR/VL FMAs.
// Three builds of it exist: AVX-512 (12 x 32, 24 zmm accumulators), AVX2+FMA (6 x 16, 12 ymm accumulators) and
// a portable 128-bit one (6 x 8).  The AVX ones are compiled with per-function `target` attributes and chosen at
// run time with __builtin_cpu_supports (which also checks that the OS saves the registers), so the module
// itself needs no -march flag and runs on any x86-64 CPU.  NEEDLE_CPU_MATMUL_KERNEL=avx512|avx2|generic forces
// a choice (for tests and benchmarks; set_matmul_kernel(name) from Python).
//
// 16-bit operands are widened to float32 while they are packed, so the same micro-kernels serve them.  The one
// exception: on CPUs with AVX512-BF16, bfloat16 products keep their 16 bits through packing and use a
// fourth micro-kernel built on the VDPBF16PS dot-product instruction (twice the multiply-adds per instruction;
// see "bfloat16 products with VDPBF16PS" below).  It is used while the avx512 kernel is selected and the switch
// is on: on by default, off with NEEDLE_CPU_MATMUL_BF16_DOT=0 or set_matmul_bf16_dot(False); matmul_bf16_dot()
// reads the switch.  Off (or with another kernel selected), bfloat16 is widened like float16.

// C[i * ldc + j] (+)= sum_k Ap[k * MR + i] * Bp[k * NR + j]  for i < mr, j < nr
typedef void (*ukernel_fn)(int64_t kc, const scalar_t* Ap, const scalar_t* Bp, scalar_t* C, int64_t ldc,
                           int64_t mr, int64_t nr, bool accumulate);

// Writes the MR x (NV * VL) tile acc into C (or adds it to C when `accumulate`): whole vectors for a full tile,
// element by element for an edge tile, of which only mr x nr belong to C.
template <class V, int MR, int NV>
static inline __attribute__((always_inline)) void store_tile(V (&acc)[MR][NV], scalar_t* __restrict C,
                                                              int64_t ldc, int64_t mr, int64_t nr, bool accumulate) {
  constexpr int VL = sizeof(V) / sizeof(scalar_t);
  constexpr int NR = NV * VL;
  if (mr == MR && nr == NR) {
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) {
        scalar_t* c = C + i * ldc + j * VL;
        if (accumulate) {
          V old;
          __builtin_memcpy(&old, c, sizeof(V));
          acc[i][j] += old;
        }
        __builtin_memcpy(c, &acc[i][j], sizeof(V));
      }
  } else {  // edge tile: only mr x nr of the computed tile belong to C
    scalar_t tile[MR * NR];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) __builtin_memcpy(tile + i * NR + j * VL, &acc[i][j], sizeof(V));
    for (int64_t i = 0; i < mr; ++i)
      for (int64_t j = 0; j < nr; ++j) {
        scalar_t& c = C[i * ldc + j];
        c = (accumulate ? c : 0.0f) + tile[i * NR + j];
      }
  }
}

template <class V, int MR, int NV>
static inline __attribute__((always_inline)) void ukernel_body(int64_t kc, const scalar_t* __restrict Ap,
                                                                const scalar_t* __restrict Bp,
                                                                scalar_t* __restrict C, int64_t ldc, int64_t mr,
                                                                int64_t nr, bool accumulate) {
  constexpr int VL = sizeof(V) / sizeof(scalar_t);
  constexpr int NR = NV * VL;
  V acc[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) acc[i][j] = V{};
  for (int64_t k = 0; k < kc; ++k) {
    V b[NV];
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) __builtin_memcpy(&b[j], Bp + j * VL, sizeof(V));
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const scalar_t a = Ap[i];
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[i][j] += a * b[j];
    }
    Ap += MR;
    Bp += NR;
  }
  store_tile<V, MR, NV>(acc, C, ldc, mr, nr, accumulate);
}

constexpr int GENERIC_MR = 6, GENERIC_NR = 8;
static void ukernel_generic(int64_t kc, const scalar_t* Ap, const scalar_t* Bp, scalar_t* C, int64_t ldc,
                            int64_t mr, int64_t nr, bool accumulate) {
  ukernel_body<v4sf, GENERIC_MR, GENERIC_NR / 4>(kc, Ap, Bp, C, ldc, mr, nr, accumulate);
}

#ifdef NEEDLE_X86_DISPATCH
constexpr int AVX2_MR = 6, AVX2_NR = 16;
constexpr int AVX512_MR = 12, AVX512_NR = 32;
__attribute__((target("avx2,fma"))) static void ukernel_avx2(int64_t kc, const scalar_t* Ap, const scalar_t* Bp,
                                                             scalar_t* C, int64_t ldc, int64_t mr, int64_t nr,
                                                             bool accumulate) {
  ukernel_body<v8sf, AVX2_MR, AVX2_NR / 8>(kc, Ap, Bp, C, ldc, mr, nr, accumulate);
}
__attribute__((target("avx512f,avx512vl,avx2,fma"))) static void ukernel_avx512(
    int64_t kc, const scalar_t* Ap, const scalar_t* Bp, scalar_t* C, int64_t ldc, int64_t mr, int64_t nr,
    bool accumulate) {
  ukernel_body<v16sf, AVX512_MR, AVX512_NR / 16>(kc, Ap, Bp, C, ldc, mr, nr, accumulate);
}
#endif

// A grow-only, 64-byte aligned scratch buffer, thread_local to the calling thread and reused across calls so
// that packing never pays for fresh pages.  Not counted in memory_stats (that counts Arrays only).
class Scratch {
 public:
  ~Scratch() { std::free(ptr_); }
  // Room for n elements of T (the packed panels' element type); nullptr if the allocation failed.
  template <class T>
  T* get(size_t n) {
    const size_t bytes = (n * sizeof(T) + ALIGNMENT - 1) / ALIGNMENT * ALIGNMENT;
    if (bytes > cap_) {
      std::free(ptr_);
      ptr_ = std::aligned_alloc(ALIGNMENT, bytes);
      cap_ = ptr_ == nullptr ? 0 : bytes;
    }
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  size_t cap_ = 0;  // bytes
};

constexpr int64_t MC_MAX = 96;  // rows of A per packed block (MC x KC floats: 96 KiB, in L2)
constexpr int64_t NC = 3072;  // columns of B per packed block (KC x NC floats: 3 MiB, in L2/L3)
constexpr int64_t BF16_DOT_KC = 512;  // KC of the bfloat16 dot-product kernel (the same bytes as the float KC)

static inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Ap[k][i] = A[r0 + i][c0 + k]: one MR-row micro-panel of A (rows past `rows` are zero).  Packing is also where
// 16-bit operands are widened to float32: the micro-kernel only ever sees float panels.
template <int MR, class T>
static void pack_a_panel(const T* A, int64_t lda, int64_t r0, int64_t rows, int64_t c0, int64_t kc,
                         scalar_t* Ap) {
  const T* src = A + r0 * lda + c0;
  if (rows == MR) {
    for (int64_t k = 0; k < kc; ++k)
      for (int i = 0; i < MR; ++i) Ap[k * MR + i] = to_float(src[i * lda + k]);
  } else {
    for (int64_t k = 0; k < kc; ++k)
      for (int i = 0; i < MR; ++i) Ap[k * MR + i] = i < rows ? to_float(src[i * lda + k]) : 0.0f;
  }
}

// Bp[k][j] = B[r0 + k][c0 + j]: one NR-column micro-panel of B (columns past `cols` are zero).
template <int NR, class T>
static void pack_b_panel(const T* B, int64_t ldb, int64_t r0, int64_t kc, int64_t c0, int64_t cols,
                         scalar_t* Bp) {
  const T* src = B + r0 * ldb + c0;
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (std::is_same<T, float>::value) {
      std::memcpy(Bp + k * NR, src + k * ldb, static_cast<size_t>(cols) * ELEM_SIZE);
    } else {
      for (int64_t j = 0; j < cols; ++j) Bp[k * NR + j] = to_float(src[k * ldb + j]);
    }
    for (int64_t j = cols; j < NR; ++j) Bp[k * NR + j] = 0.0f;
  }
}

// The same panels from a transposed operand, read where it is: A given as At (n x m) row-major, so that
// A[r][c] = At[c * lda + r] (lda = m), and B as Bt (p x n), B[r][c] = Bt[c * ldb + r] (ldb = n).  The panels hold
// the same numbers in the same order as from a transposed copy, so the product's bits are the same, without the
// copy (a Linear's gradient multiplies by W^T and x^T).
template <int MR, class T>
static void pack_a_panel_t(const T* At, int64_t lda, int64_t r0, int64_t rows, int64_t c0, int64_t kc,
                           scalar_t* Ap) {
  for (int64_t k = 0; k < kc; ++k) {
    const T* src = At + (c0 + k) * lda + r0;  // A[r0 .. r0 + rows][c0 + k]: contiguous in At
    for (int i = 0; i < MR; ++i) Ap[k * MR + i] = i < rows ? to_float(src[i]) : 0.0f;
  }
}

template <int NR, class T>
static void pack_b_panel_t(const T* Bt, int64_t ldb, int64_t r0, int64_t kc, int64_t c0, int64_t cols,
                           scalar_t* Bp) {
  for (int64_t j = 0; j < NR; ++j) {
    const T* src = Bt + (c0 + j) * ldb + r0;  // B[r0 .. r0 + kc][c0 + j]: contiguous in Bt
    for (int64_t k = 0; k < kc; ++k) Bp[k * NR + j] = j < cols ? to_float(src[k]) : 0.0f;
  }
}

// The panels gemm_packed works on, and the micro-kernel that reads them.  Here float panels (into which float32
// and 16-bit operands alike are packed, widened) read by the float micro-kernel UK; Bf16Pairs (below) is the
// other kind.  A panel holding kc steps of k has depth(kc) rows: MR (or NR) packed values each.
template <int MR_, int NR_, ukernel_fn UK, class T, bool TRANS_A_ = false, bool TRANS_B_ = false>
struct FloatPanels {
  using input_t = T;
  using packed_t = scalar_t;
  static constexpr int MR = MR_, NR = NR_;
  static constexpr bool TRANS_A = TRANS_A_, TRANS_B = TRANS_B_;  // operands given transposed (pack_*_panel_t)
  static constexpr int64_t KC = 256;  // depth of one packed block: a KC x NR B micro-panel (32 KiB at NR=32), L1
  static int64_t depth(int64_t kc) { return kc; }
  static void pack_a(const T* A, int64_t lda, int64_t r0, int64_t rows, int64_t c0, int64_t kc, packed_t* Ap) {
    if constexpr (TRANS_A) {
      pack_a_panel_t<MR>(A, lda, r0, rows, c0, kc, Ap);
    } else {
      pack_a_panel<MR>(A, lda, r0, rows, c0, kc, Ap);
    }
  }
  static void pack_b(const T* B, int64_t ldb, int64_t r0, int64_t kc, int64_t c0, int64_t cols, packed_t* Bp) {
    if constexpr (TRANS_B) {
      pack_b_panel_t<NR>(B, ldb, r0, kc, c0, cols, Bp);
    } else {
      pack_b_panel<NR>(B, ldb, r0, kc, c0, cols, Bp);
    }
  }
  static void kernel(int64_t depth, const packed_t* Ap, const packed_t* Bp, scalar_t* C, int64_t ldc, int64_t mr,
                     int64_t nr, bool accumulate) {
    UK(depth, Ap, Bp, C, ldc, mr, nr, accumulate);
  }
};

#ifdef NEEDLE_BF16_DOT
// ---- bfloat16 products with VDPBF16PS (AVX512-BF16) ----------------------------------------------------------
//
// VDPBF16PS (_mm512_dpbf16_ps(acc, a, b)) reads each 32-bit lane of a and b as a pair of bfloat16 values (low
// half first) and adds both products of a lane to that lane's float32 accumulator:
//     acc[l] += a[l].lo * b[l].lo + a[l].hi * b[l].hi        for the 16 lanes l of a zmm register
// One instruction thus does two steps of k for 16 columns: twice the multiply-adds of a float32 FMA, reading
// half the bytes.  The micro-kernel is the AVX-512 float one (a 12 x 32 tile of C in 24 zmm accumulators) with
// k taken two at a time.  For the pair rows q < ceil(kc / 2) of a block, the panels hold 32-bit pairs:
//
//   Ap[q * MR + i] = A[i][2q] | A[i][2q + 1] << 16    (row i of the panel: two neighbours in memory, one load)
//   Bp[q * NR + j] = B[2q][j] | B[2q + 1][j] << 16    (column j: the same two k, from two rows of B)
//
// (the bfloat16 bit patterns, k = 2q in the low half).  Per pair row q the kernel loads Bp's NR = 32 pairs (two
// zmm of 16) and, for each row i, broadcasts the pair Ap[q * MR + i] to all 16 lanes and issues one VDPBF16PS per
// zmm: lane l of acc[i][v] gains A[i][2q] B[2q][16v + l] + A[i][2q + 1] B[2q + 1][16v + l], which are exactly
// the two terms k = 2q, 2q + 1 of C[i][16v + l].  When kc is odd the last pair's upper half is zero in both A
// and B (0 * 0 adds nothing, where 0 * an arbitrary value could be NaN); rows past `rows` and columns past
// `cols` are zero pairs, as in the float panels.  KC = 512 makes a panel as many bytes as the float one; it is
// even, so a pair never straddles two blocks and only the last block of an odd n has an odd kc.
//
// How the results differ from the widening kernels (both accumulate in float32; the difference is within the
// float32-accumulation error, n * 2^-24 * sum |a_k b_k| for n terms):
//   - order: a product of two bfloat16 values is exact in float32 in both paths, but VDPBF16PS adds the two
//     products of a pair to the accumulator in its own order, each addition rounded (Intel documents the upper
//     one, k = 2q + 1, first; measured the same on AMD Zen 4), where the widening kernel adds one k after the other;
//   - denormals: VDPBF16PS treats denormal inputs as zero and flushes denormal results to zero whatever MXCSR
//     says (the widening path keeps them).  Only magnitudes below 2^-126 (~1.2e-38) are affected.
// Like the float kernels, every element of C is summed in one fixed order, so results do not depend on threads.
//
// A bfloat16 out: when n <= KC the whole sum is in the registers at the end (one k block, no float32 partial
// sums to keep between blocks), so the micro-kernel rounds it to bfloat16 there and writes out directly
// (store_tile_bf16): no float32 temporary and no rounding pass over it, the same bits as rounding afterwards.
#define NEEDLE_BF16_TARGET __attribute__((target("avx512f,avx512vl,avx512bw,avx512bf16,avx2,fma")))
constexpr int BF16_MR = 12, BF16_NR = 32;

// Ap[q * MR + i] = the pair (A[r0 + i][c0 + 2q], A[r0 + i][c0 + 2q + 1]) for q < ceil(kc / 2), i < MR.
NEEDLE_BF16_TARGET static void pack_a_pairs(const bfloat16_t* A, int64_t lda, int64_t r0, int64_t rows,
                                            int64_t c0, int64_t kc, uint32_t* Ap) {
  const int64_t full = kc / 2, depth = (kc + 1) / 2;  // pairs with both halves in the block; all pairs
  for (int i = 0; i < BF16_MR; ++i) {
    uint32_t* dst = Ap + i;
    if (i >= rows) {
      for (int64_t q = 0; q < depth; ++q) dst[q * BF16_MR] = 0;
      continue;
    }
    const bfloat16_t* row = A + (r0 + i) * lda + c0;
    for (int64_t q = 0; q < full; ++q) std::memcpy(&dst[q * BF16_MR], row + 2 * q, 4);  // (little-endian)
    if (kc % 2) dst[full * BF16_MR] = row[kc - 1].bits;
  }
}

// Bp[q * NR + j] = the pair (B[r0 + 2q][c0 + j], B[r0 + 2q + 1][c0 + j]) for q < ceil(kc / 2), j < NR.
NEEDLE_BF16_TARGET static void pack_b_pairs(const bfloat16_t* B, int64_t ldb, int64_t r0, int64_t kc, int64_t c0,
                                            int64_t cols, uint32_t* Bp) {
  for (int64_t q = 0; q < (kc + 1) / 2; ++q) {
    const bfloat16_t* lo = B + (r0 + 2 * q) * ldb + c0;
    uint32_t* dst = Bp + q * BF16_NR;
    if (2 * q + 1 < kc) {
      const bfloat16_t* hi = lo + ldb;
      for (int64_t j = 0; j < cols; ++j) dst[j] = uint32_t(lo[j].bits) | uint32_t(hi[j].bits) << 16;
    } else {
      for (int64_t j = 0; j < cols; ++j) dst[j] = lo[j].bits;
    }
    for (int64_t j = cols; j < BF16_NR; ++j) dst[j] = 0;
  }
}

// Rounds the tile to bfloat16 exactly as from_float<bfloat16_t> does (nearest, ties to even; a NaN stays a quiet
// NaN), 16 lanes at a time, and writes its mr x nr part to C (bfloat16, rows ldc apart).
template <int MR, int NV>
static inline __attribute__((always_inline)) void store_tile_bf16(v16sf (&acc)[MR][NV], bfloat16_t* C,
                                                                   int64_t ldc, int64_t mr, int64_t nr) {
  typedef uint32_t v16su __attribute__((vector_size(64)));
  typedef uint16_t v16hu __attribute__((vector_size(32)));
  for (int64_t i = 0; i < mr; ++i)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const v16su u = (v16su)acc[i][v];
      const v16su rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      const v16su quiet_nan = (u >> 16) | 0x0040u;
      const v16hu h = __builtin_convertvector((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded, v16hu);
      const int64_t cols = std::min<int64_t>(16, nr - 16 * v);
      if (cols == 16) {
        __builtin_memcpy(C + i * ldc + 16 * v, &h, sizeof(h));
      } else {
        for (int64_t j = 0; j < cols; ++j) C[i * ldc + 16 * v + j].bits = h[j];
      }
    }
}

// C[i * ldc + j] (+)= sum_q dot(Ap[q * MR + i], Bp[q * NR + j])  for i < mr, j < nr, over `depth` pair rows.
// O is float, or bfloat16_t for a product of one k block (accumulate is then false).
template <class O>
NEEDLE_BF16_TARGET static void ukernel_avx512_bf16(int64_t depth, const uint32_t* Ap, const uint32_t* Bp, O* C,
                                                   int64_t ldc, int64_t mr, int64_t nr, bool accumulate) {
  constexpr int NV = BF16_NR / 16;
  v16sf acc[BF16_MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < BF16_MR; ++i)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[i][v] = v16sf{};
  for (int64_t q = 0; q < depth; ++q) {
    __m512bh b[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(Bp + 16 * v);
#pragma GCC unroll 16
    for (int i = 0; i < BF16_MR; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(Ap[i]));
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[i][v] = (v16sf)_mm512_dpbf16_ps((__m512)acc[i][v], a, b[v]);
    }
    Ap += BF16_MR;
    Bp += BF16_NR;
  }
  if constexpr (std::is_same<O, bfloat16_t>::value) {
    store_tile_bf16<BF16_MR, NV>(acc, C, ldc, mr, nr);
  } else {
    store_tile<v16sf, BF16_MR, NV>(acc, C, ldc, mr, nr, accumulate);
  }
}

struct Bf16Pairs {
  using input_t = bfloat16_t;
  using packed_t = uint32_t;
  static constexpr int MR = BF16_MR, NR = BF16_NR;
  static constexpr bool TRANS_A = false, TRANS_B = false;
  static constexpr int64_t KC = BF16_DOT_KC;
  static int64_t depth(int64_t kc) { return (kc + 1) / 2; }
  static void pack_a(const bfloat16_t* A, int64_t lda, int64_t r0, int64_t rows, int64_t c0, int64_t kc,
                     packed_t* Ap) {
    pack_a_pairs(A, lda, r0, rows, c0, kc, Ap);
  }
  static void pack_b(const bfloat16_t* B, int64_t ldb, int64_t r0, int64_t kc, int64_t c0, int64_t cols,
                     packed_t* Bp) {
    pack_b_pairs(B, ldb, r0, kc, c0, cols, Bp);
  }
  template <class O>
  static void kernel(int64_t depth, const packed_t* Ap, const packed_t* Bp, O* C, int64_t ldc, int64_t mr,
                     int64_t nr, bool accumulate) {
    ukernel_avx512_bf16<O>(depth, Ap, Bp, C, ldc, mr, nr, accumulate);
  }
};
#endif  // NEEDLE_BF16_DOT

// The calling thread's buffers for packed A panels and for the packed B block.
static Scratch& a_scratch() {
  static thread_local Scratch scratch;
  return scratch;
}
static Scratch& b_scratch() {
  static thread_local Scratch scratch;
  return scratch;
}

// C (m x p) = A (m x n) @ B (n x p), all compact row-major; A and B of P's input type, C float32 (O = float) or,
// for Bf16Pairs with n <= KC, bfloat16.  P says how the panels are packed and which micro-kernel reads them
// (FloatPanels, Bf16Pairs).
template <class P, class O = scalar_t>
static void gemm_packed(const typename P::input_t* A, const typename P::input_t* B, O* C, int64_t m, int64_t n,
                        int64_t p, int nthreads) {
  using packed_t = typename P::packed_t;
  constexpr int64_t MR = P::MR, NR = P::NR, KC = P::KC;
  // Row blocks: about 4 per thread for balance, a multiple of MR, at most MC_MAX.
  const int64_t mc_max = std::min(MC_MAX, ceil_div(ceil_div(m, 4 * nthreads), MR) * MR);
  const int64_t nblocks = ceil_div(m, mc_max);
  const int64_t nc_max = std::min(NC, ceil_div(p, NR) * NR);
  const int64_t depth_max = P::depth(std::min(KC, n));
  // The packed B block is shared by the threads (the calling thread's buffer); each thread packs its own A.
  packed_t* Bp = b_scratch().get<packed_t>(static_cast<size_t>(depth_max * nc_max));
  if (Bp == nullptr) throw std::bad_alloc();

  // Row pitches of A and B as stored: (m x n) and (n x p) row-major, or their transposes.
  const int64_t lda = P::TRANS_A ? m : n, ldb = P::TRANS_B ? n : p;
  // The two steps of each (jc, pc) block: pack B micro-panel jp, and compute row block blk of C with Ap.
  auto pack_b = [&](int64_t jc, int64_t nc, int64_t pc, int64_t kc, int64_t jp) {
    P::pack_b(B, ldb, pc, kc, jc + jp * NR, std::min<int64_t>(NR, nc - jp * NR), Bp + jp * NR * P::depth(kc));
  };
  auto row_block = [&](packed_t* Ap, int64_t jc, int64_t nc, int64_t pc, int64_t kc, int64_t blk) {
    const int64_t ic = blk * mc_max, mc = std::min(mc_max, m - ic), depth = P::depth(kc);
    for (int64_t ir = 0; ir < mc; ir += MR)
      P::pack_a(A, lda, ic + ir, std::min<int64_t>(MR, mc - ir), pc, kc, Ap + ir * depth);
    for (int64_t jr = 0; jr < nc; jr += NR)
      for (int64_t ir = 0; ir < mc; ir += MR)
        P::kernel(depth, Ap + ir * depth, Bp + jr * depth, C + (ic + ir) * p + jc + jr, p,
                  std::min<int64_t>(MR, mc - ir), std::min<int64_t>(NR, nc - jr), pc > 0);
  };

  if (nthreads == 1) {  // no OpenMP region at all: even an inactive one costs about as much as a small product
    packed_t* Ap = a_scratch().get<packed_t>(static_cast<size_t>(mc_max * depth_max));
    if (Ap == nullptr) throw std::bad_alloc();
    for (int64_t jc = 0; jc < p; jc += NC) {
      const int64_t nc = std::min(NC, p - jc);
      for (int64_t pc = 0; pc < n; pc += KC) {
        const int64_t kc = std::min(KC, n - pc);
        for (int64_t jp = 0; jp < ceil_div(nc, NR); ++jp) pack_b(jc, nc, pc, kc, jp);
        for (int64_t blk = 0; blk < nblocks; ++blk) row_block(Ap, jc, nc, pc, kc, blk);
      }
    }
    return;
  }

  int failed = 0;
#pragma omp parallel num_threads(nthreads)
  {
    packed_t* Ap = a_scratch().get<packed_t>(static_cast<size_t>(mc_max * depth_max));
    if (Ap == nullptr) {
#pragma omp atomic write
      failed = 1;
    }
    for (int64_t jc = 0; jc < p; jc += NC) {
      const int64_t nc = std::min(NC, p - jc);
      const int64_t n_jr = ceil_div(nc, NR);
      for (int64_t pc = 0; pc < n; pc += KC) {
        const int64_t kc = std::min(KC, n - pc);
#pragma omp for schedule(static)
        for (int64_t jp = 0; jp < n_jr; ++jp) pack_b(jc, nc, pc, kc, jp);
        // (barrier: B is packed before anyone uses it)  Row blocks go to whichever thread is free, so the
        // threads stay balanced even when another process shares a core.
#pragma omp for schedule(dynamic, 1)
        for (int64_t blk = 0; blk < nblocks; ++blk) {
          if (Ap != nullptr) row_block(Ap, jc, nc, pc, kc, blk);
        }
        // (barrier: nobody still reads Bp when it is packed again)
      }
    }
  }
  if (failed) throw std::bad_alloc();
}

// Small products, and those with very few rows: no packing.  Columns are taken in chunks of JB so that the
// rows of C being summed stay in L1 while B's chunk is read once per group of up to 4 rows.
static void gemm_small(const scalar_t* __restrict A, const scalar_t* __restrict B, scalar_t* __restrict C,
                       int64_t m, int64_t n, int64_t p, int nthreads) {
  constexpr int64_t JB = 512, IB = 4;
  const int64_t chunks = ceil_div(p, JB);
  auto chunk = [&](int64_t jb) {
    const int64_t j0 = jb * JB, len = std::min(JB, p - j0);
    for (int64_t i0 = 0; i0 < m; i0 += IB) {
      const int64_t rows = std::min(IB, m - i0);
      for (int64_t i = i0; i < i0 + rows; ++i) std::fill(C + i * p + j0, C + i * p + j0 + len, 0.0f);
      for (int64_t k = 0; k < n; ++k) {
        const scalar_t* b = B + k * p + j0;
        for (int64_t i = i0; i < i0 + rows; ++i) {
          const scalar_t a = A[i * n + k];
          scalar_t* c = C + i * p + j0;
          for (int64_t j = 0; j < len; ++j) c[j] += a * b[j];
        }
      }
    }
  };
  if (nthreads > 1 && chunks > 1) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t jb = 0; jb < chunks; ++jb) chunk(jb);
  } else {  // no OpenMP region at all: even an inactive one costs ~1 us, more than a small product
    for (int64_t jb = 0; jb < chunks; ++jb) chunk(jb);
  }
}

// p == 1: one dot product per row of A.
static void gemv(const scalar_t* A, const scalar_t* x, scalar_t* y, int64_t m, int64_t n, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t i = 0; i < m; ++i) {
    const scalar_t* a = A + i * n;
    scalar_t s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < n; ++k) s += a[k] * x[k];
    y[i] = s;
  }
}

template <class T, class O = scalar_t>
using gemm_fn = void (*)(const T*, const T*, O*, int64_t, int64_t, int64_t, int);

// One micro-kernel, and the packed GEMM built on it for each storage type of A and B; the AVX-512 one also has
// the bfloat16 dot-product GEMM (Bf16Pairs), used for bfloat16 products when g_bf16_dot is on.
struct MatmulKernel {
  const char* name;
  gemm_fn<float> gemm;
  gemm_fn<float> gemm_ta, gemm_tb, gemm_tab;  // float32 with A, B or both given transposed
  gemm_fn<bfloat16_t> gemm_bf16;
  gemm_fn<half_t> gemm_f16;
  int mr, nr;
  gemm_fn<bfloat16_t> gemm_bf16_dot;  // nullptr: none
  gemm_fn<bfloat16_t, bfloat16_t> gemm_bf16_dot_to_bf16;  // the same with bfloat16 out, for n <= BF16_DOT_KC
};

#define NEEDLE_MATMUL_KERNEL(NAME, MR, NR, UK, BF16_DOT, BF16_DOT_TO_BF16)                                \
  {NAME, gemm_packed<FloatPanels<MR, NR, UK, float>>, gemm_packed<FloatPanels<MR, NR, UK, float, true, false>>, \
   gemm_packed<FloatPanels<MR, NR, UK, float, false, true>>, gemm_packed<FloatPanels<MR, NR, UK, float, true, true>>, \
   gemm_packed<FloatPanels<MR, NR, UK, bfloat16_t>>, gemm_packed<FloatPanels<MR, NR, UK, half_t>>, MR, NR,     \
   BF16_DOT, BF16_DOT_TO_BF16}
static const MatmulKernel KERNEL_GENERIC =
    NEEDLE_MATMUL_KERNEL("generic", GENERIC_MR, GENERIC_NR, ukernel_generic, nullptr, nullptr);
#ifdef NEEDLE_X86_DISPATCH
static const MatmulKernel KERNEL_AVX2 =
    NEEDLE_MATMUL_KERNEL("avx2", AVX2_MR, AVX2_NR, ukernel_avx2, nullptr, nullptr);
#ifdef NEEDLE_BF16_DOT
static const MatmulKernel KERNEL_AVX512 = NEEDLE_MATMUL_KERNEL("avx512", AVX512_MR, AVX512_NR, ukernel_avx512,
                                                               gemm_packed<Bf16Pairs>,
                                                               (gemm_packed<Bf16Pairs, bfloat16_t>));
#else
static const MatmulKernel KERNEL_AVX512 =
    NEEDLE_MATMUL_KERNEL("avx512", AVX512_MR, AVX512_NR, ukernel_avx512, nullptr, nullptr);
#endif
#endif

static const MatmulKernel* kernel_by_name(const std::string& name) {
  if (!cpu_has(name.c_str())) return nullptr;
#ifdef NEEDLE_X86_DISPATCH
  if (name == "avx512") return &KERNEL_AVX512;
  if (name == "avx2") return &KERNEL_AVX2;
#endif
  return &KERNEL_GENERIC;
}

static const MatmulKernel* g_kernel = nullptr;  // chosen at import

static void choose_kernel() {
  const char* env = std::getenv("NEEDLE_CPU_MATMUL_KERNEL");
  if (env != nullptr && *env != '\0') {
    g_kernel = kernel_by_name(env);
    if (g_kernel != nullptr) return;
  }
  for (const char* name : {"avx512", "avx2", "generic"}) {
    g_kernel = kernel_by_name(name);
    if (g_kernel != nullptr) return;
  }
}

static void set_matmul_kernel(const std::string& name) {
  const MatmulKernel* k = kernel_by_name(name);
  if (k == nullptr) fail("set_matmul_kernel: '" + name + "' is unknown or not supported by this CPU");
  g_kernel = k;
}

// Whether this CPU (and OS) runs the bfloat16 dot-product kernel (VDPBF16PS), and the switch g_bf16_dot: on at
// import where the CPU has it, unless NEEDLE_CPU_MATMUL_BF16_DOT=0; set_matmul_bf16_dot sets it.  The kernel is
// only used while the avx512 kernel is the selected one: with set_matmul_kernel("avx2"), say, bfloat16 goes
// through the avx2 kernel, widened, whatever the switch says.
static bool cpu_has_bf16_dot() {
#ifdef NEEDLE_BF16_DOT
  __builtin_cpu_init();
  return cpu_has("avx512") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

static bool g_bf16_dot = false;

static void choose_bf16_dot() {
  const char* env = std::getenv("NEEDLE_CPU_MATMUL_BF16_DOT");
  g_bf16_dot = cpu_has_bf16_dot() && !(env != nullptr && std::strcmp(env, "0") == 0);
}

// Whether bfloat16 products take the dot-product kernel now: switched on, and the avx512 kernel selected.
static bool use_bf16_dot() { return g_bf16_dot && g_kernel->gemm_bf16_dot != nullptr; }

static void set_matmul_bf16_dot(bool enabled) {
  if (enabled && !cpu_has_bf16_dot())
    fail("set_matmul_bf16_dot: this CPU (or this build) has no AVX512-BF16 dot-product kernel");
  g_bf16_dot = enabled;
}

static void check_matmul(const char* fn, const Array& a, const Array& b, const Array& out, int64_t m, int64_t n,
                         int64_t p) {
  if (m < 0 || n < 0 || p < 0) fail(std::string(fn) + ": m, n, p must be >= 0");
  check_size(fn, "a", a.size, static_cast<size_t>(m) * static_cast<size_t>(n));
  check_size(fn, "b", b.size, static_cast<size_t>(n) * static_cast<size_t>(p));
  check_size(fn, "out", out.size, static_cast<size_t>(m) * static_cast<size_t>(p));
  if (out.size != 0 && (out.ptr == a.ptr || out.ptr == b.ptr))
    fail(std::string(fn) + ": out must not be one of the inputs");
}

// C (m x p) = A (m x n) @ B (n x p) for m, n, p > 0 on `nthreads` threads, with the kernel that suits the shape.
// Whether a float32 product of this shape takes the packed kernel (else gemv or gemm_small, unpacked).
static bool uses_packed_kernel(int64_t m, int64_t n, int64_t p) {
  const double flops = 2.0 * double(m) * double(n) * double(p);
  return p != 1 && !(flops < 2.0 * 8 * 8 * 8 || (m < g_kernel->mr / 2 && m < p));
}

static void gemm(const scalar_t* A, const scalar_t* B, scalar_t* C, int64_t m, int64_t n, int64_t p,
                 int nthreads) {
  if (p == 1) {
    gemv(A, B, C, m, n, nthreads);
  } else if (!uses_packed_kernel(m, n, p)) {
    gemm_small(A, B, C, m, n, p, nthreads);
  } else {
    g_kernel->gemm(A, B, C, m, n, p, nthreads);
  }
}

// 16-bit A and B: always a packed kernel (no unpacked small-matrix paths): for bfloat16 the dot-product one when
// it is on, else the selected kernel, which widens them while packing.
static void gemm(const bfloat16_t* A, const bfloat16_t* B, scalar_t* C, int64_t m, int64_t n, int64_t p,
                 int nthreads) {
  if (use_bf16_dot()) {
    g_kernel->gemm_bf16_dot(A, B, C, m, n, p, nthreads);
  } else {
    g_kernel->gemm_bf16(A, B, C, m, n, p, nthreads);
  }
}
static void gemm(const half_t* A, const half_t* B, scalar_t* C, int64_t m, int64_t n, int64_t p, int nthreads) {
  g_kernel->gemm_f16(A, B, C, m, n, p, nthreads);
}

// A bfloat16 product with a bfloat16 out is rounded in the dot-product kernel's registers and written to out
// directly (store_tile_bf16) when the kernel is in use and n <= its KC; otherwise it accumulates in a float32
// Accumulator that is rounded afterwards.  The bits are the same either way.
static bool bf16_out_direct(DType dt, const Array& out, int64_t n) {
  return dt == DType::bf16 && out.dtype == DType::bf16 && use_bf16_dot() && n <= BF16_DOT_KC;
}
static void gemm(const bfloat16_t* A, const bfloat16_t* B, bfloat16_t* C, int64_t m, int64_t n, int64_t p,
                 int nthreads) {
  g_kernel->gemm_bf16_dot_to_bf16(A, B, C, m, n, p, nthreads);
}

// The dtypes of a matmul: a and b one floating dtype, out the same or float32.  Returns a's.
static DType check_matmul_dtypes(const char* fn, const Array& a, const Array& b, const Array& out) {
  const DType d = a.dtype;
  if (!info(d).floating || b.dtype != d || (out.dtype != d && out.dtype != DType::f32)) {
    throw py::type_error(std::string(fn) + ": needs floating a and b of one dtype and out of that dtype or "
                         "float32, got " + a.dtype_name() + ", " + b.dtype_name() + " and " + out.dtype_name());
  }
  return d;
}

// Where a product accumulates: out itself when it is float32, else a float32 Array of out's size (counted by the
// memory statistics like any buffer) that is rounded into out at the end.
struct Accumulator {
  explicit Accumulator(Array& out) : out(out) {
    if (out.dtype != DType::f32) tmp.reset(new Array(out.size));
  }
  scalar_t* data() { return tmp ? tmp->ptr : out.ptr; }
  void finish() {
    if (out.dtype == DType::f32) return;
    visit_float(out.dtype, [&](auto t) {
      using T = decltype(t);
      const float* src = tmp->ptr;
      T* dst = out.data<T>();
      parallel_range(out.size, threads_for(out.size, false), [&](size_t begin, size_t end) {
        for (size_t i = begin; i < end; ++i) dst[i] = from_float<T>(src[i]);
      });
    });
  }
  Array& out;
  std::unique_ptr<Array> tmp;
};

// Threads pay off past ~0.5 MFLOP.
static int matmul_threads(int64_t m, int64_t n, int64_t p) {
  return 2.0 * double(m) * double(n) * double(p) < 2.0 * 64 * 64 * 64 ? 1 : num_threads();
}

// out = A @ B with A, B compact (m x n) and (n x p) arrays of storage type T.
template <class T>
static void matmul_compact(const T* A, const T* B, Array& out, DType dt, int64_t m, int64_t n, int64_t p) {
  if constexpr (std::is_same<T, bfloat16_t>::value) {
    if (bf16_out_direct(dt, out, n)) {
      py::gil_scoped_release release;
      gemm(A, B, out.data<bfloat16_t>(), m, n, p, matmul_threads(m, n, p));
      return;
    }
  }
  Accumulator acc(out);
  {
    py::gil_scoped_release release;
    gemm(A, B, acc.data(), m, n, p, matmul_threads(m, n, p));
  }
  acc.finish();
}

// The (cols x rows) row-major transpose of a (rows x cols) row-major matrix, outside the allocator (like the
// packing buffers): for the products that do not pack their operands.
template <class T>
static std::vector<T> transposed(const T* src, int64_t rows, int64_t cols) {
  std::vector<T> t(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[static_cast<size_t>(c * rows + r)] = src[r * cols + c];
  return t;
}

// trans_a: a holds A's transpose, (n x m) row-major; trans_b: b holds B's, (p x n).  A float32 product on the
// packed kernel reads them in place while packing; any other transposes them into temporaries outside the
// allocator first.  Either way no buffer the allocator counts is made, and the bits are those of the product of
// compact copies.
static void matmul(const Array& a, const Array& b, Array& out, int64_t m, int64_t n, int64_t p, bool trans_a,
                   bool trans_b) {
  check_matmul("matmul", a, b, out, m, n, p);
  const DType dt = check_matmul_dtypes("matmul", a, b, out);
  if (m == 0 || p == 0) return;
  if (n == 0) {
    fill(out, 0.0f);
    return;
  }
  if ((trans_a || trans_b) && dt == DType::f32 && uses_packed_kernel(m, n, p)) {
    const gemm_fn<float> f = !trans_b ? g_kernel->gemm_ta : !trans_a ? g_kernel->gemm_tb : g_kernel->gemm_tab;
    py::gil_scoped_release release;
    f(a.data<float>(), b.data<float>(), out.ptr, m, n, p, matmul_threads(m, n, p));
    return;
  }
  visit_float(dt, [&](auto t) {
    using T = decltype(t);
    std::vector<T> at, bt;
    if (trans_a) at = transposed(a.data<T>(), n, m);
    if (trans_b) bt = transposed(b.data<T>(), p, n);
    matmul_compact(trans_a ? at.data() : a.data<T>(), trans_b ? bt.data() : b.data<T>(), out, dt, m, n, p);
  });
}

// out[i] = a[i] @ b[i] for i < batch, each product with `per_product` threads, `nthreads` products at a time.
// Returns false if a product failed (an exception must not leave an OpenMP region: it is noted instead).
template <class T, class O>
static bool gemm_batch(const T* a, const T* b, O* out, int64_t batch, int64_t m, int64_t n, int64_t p,
                       int nthreads, int per_product) {
  int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
  for (int64_t i = 0; i < batch; ++i) {
    try {
      gemm(a + i * m * n, b + i * n * p, out + i * m * p, m, n, p, per_product);
    } catch (...) {
#pragma omp atomic write
      failed = 1;
    }
  }
  return failed == 0;
}

// out[i] = a[i] @ b[i] for i < batch: a is (batch, m, n), b (batch, n, p), out (batch, m, p), all compact.
// Products of up to ~256^3 multiply-adds, the attention case of many small matrices, are spread over the
// threads one whole product each, which pays no per-product threading cost; bigger ones run one after another,
// each on all threads (as `matmul` runs them).  A product's bits do not depend on its thread count, so a batch
// gives exactly what a loop of matmuls gives.
static void matmul_batched(const Array& a, const Array& b, Array& out, int64_t batch, int64_t m, int64_t n,
                           int64_t p) {
  if (batch < 0) fail("matmul_batched: batch must be >= 0");
  if (m < 0 || n < 0 || p < 0) fail("matmul_batched: m, n, p must be >= 0");
  const size_t nb = static_cast<size_t>(batch);
  check_size("matmul_batched", "a", a.size, nb * static_cast<size_t>(m) * static_cast<size_t>(n));
  check_size("matmul_batched", "b", b.size, nb * static_cast<size_t>(n) * static_cast<size_t>(p));
  check_size("matmul_batched", "out", out.size, nb * static_cast<size_t>(m) * static_cast<size_t>(p));
  if (out.size != 0 && (out.ptr == a.ptr || out.ptr == b.ptr))
    fail("matmul_batched: out must not be one of the inputs");
  const DType dt = check_matmul_dtypes("matmul_batched", a, b, out);
  if (out.size == 0) return;
  if (n == 0) {
    fill(out, 0.0f);
    return;
  }
  const bool spread = batch > 1 && 2.0 * double(m) * double(n) * double(p) < 2.0 * 256 * 256 * 256;
  const int per_product = spread ? 1 : matmul_threads(m, n, p);
  const int nthreads = spread ? num_threads() : 1;
  if (bf16_out_direct(dt, out, n)) {
    bool ok = false;
    {
      py::gil_scoped_release release;
      ok = gemm_batch(a.data<bfloat16_t>(), b.data<bfloat16_t>(), out.data<bfloat16_t>(), batch, m, n, p,
                      nthreads, per_product);
    }
    if (!ok) throw std::bad_alloc();
    return;
  }
  Accumulator acc(out);
  bool ok = false;
  {
    py::gil_scoped_release release;
    visit_float(dt, [&](auto t) {
      using T = decltype(t);
      ok = gemm_batch(a.data<T>(), b.data<T>(), acc.data(), batch, m, n, p, nthreads, per_product);
    });
  }
  if (!ok) throw std::bad_alloc();
  acc.finish();
}

// The course's tiled matmul: a is (m/T, n/T, T, T), b is (n/T, p/T, T, T), out is (m/T, p/T, T, T).
static void matmul_tiled(const Array& a, const Array& b, Array& out, int64_t m, int64_t n, int64_t p) {
  check_matmul("matmul_tiled", a, b, out, m, n, p);
  require_float32("matmul_tiled", {&a, &b, &out});
  if (m % TILE || n % TILE || p % TILE) fail("matmul_tiled: m, n, p must be multiples of __tile_size__ (8)");
  const int64_t mt = m / TILE, nt = n / TILE, pt = p / TILE;
  for (int64_t i = 0; i < mt; ++i) {
    for (int64_t j = 0; j < pt; ++j) {
      scalar_t* __restrict o = out.ptr + (i * pt + j) * TILE * TILE;
      std::fill(o, o + TILE * TILE, 0.0f);
      for (int64_t k = 0; k < nt; ++k) {
        const scalar_t* __restrict at = a.ptr + (i * nt + k) * TILE * TILE;
        const scalar_t* __restrict bt = b.ptr + (k * pt + j) * TILE * TILE;
        for (int r = 0; r < TILE; ++r)
          for (int s = 0; s < TILE; ++s)
            for (int c = 0; c < TILE; ++c) o[r * TILE + c] += at[r * TILE + s] * bt[s * TILE + c];
      }
    }
  }
}

}  // namespace cpu
}  // namespace needle

#include "cpu/attention.h"  // fused attention (FlashAttention-2): attention_forward, attention_backward
#include "cpu/layernorm.h"  // fused layer norm: layernorm_forward, layernorm_backward

// ------------------------------------------------------------------------------------------------------------
// 5. The module
// ------------------------------------------------------------------------------------------------------------

PYBIND11_MODULE(ndarray_backend_cpu, m) {
  namespace py = pybind11;
  using namespace needle::cpu;

  m.doc() = "needle's C++ CPU backend (see src/README.md for the contract)";
  m.attr("__device_name__") = "cpu";
  m.attr("__tile_size__") = TILE;

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const NeedleMemoryError& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    }
  });

  py::class_<Array>(m, "Array")
      .def(py::init<size_t>(), py::return_value_policy::take_ownership, py::arg("size"))
      .def(py::init([](size_t size, const std::string& dtype) { return new Array(size, parse_dtype(dtype)); }),
           py::return_value_policy::take_ownership, py::arg("size"), py::arg("dtype"))
      .def("ptr", &Array::ptr_as_int)
      .def_readonly("size", &Array::size)
      .def_readonly("itemsize", &Array::itemsize)
      .def_property_readonly("dtype", &Array::dtype_name);

  m.def("to_numpy", to_numpy);
  m.def("from_numpy", from_numpy);
  m.def("fill", fill);
  m.def("compact", compact);
  m.def("ewise_setitem", ewise_setitem);
  m.def("scalar_setitem", scalar_setitem);
  m.def("round_stochastic", round_stochastic);
  m.def("quantize_blockwise", quantize_blockwise);
  m.def("dequantize_blockwise", dequantize_blockwise);
  m.def("adam8bit_step", adam8bit_step);
  m.def("adam_step", adam_step);
  m.def("dropout", dropout);

  m.def("ewise_add", ewise_add);
  m.def("scalar_add", scalar_add);
  m.def("ewise_mul", ewise_mul);
  m.def("scalar_mul", scalar_mul);
  m.def("ewise_div", ewise_div);
  m.def("scalar_div", scalar_div);
  m.def("scalar_power", scalar_power);
  m.def("ewise_power", ewise_power);
  m.def("ewise_maximum", ewise_maximum);
  m.def("scalar_maximum", scalar_maximum);
  m.def("ewise_eq", ewise_eq);
  m.def("scalar_eq", scalar_eq);
  m.def("ewise_ge", ewise_ge);
  m.def("ewise_gt", ewise_gt);
  m.def("scalar_ge", scalar_ge);
  m.def("scalar_gt", scalar_gt);
  m.def("ewise_log", ewise_log);
  m.def("ewise_exp", ewise_exp);
  m.def("ewise_tanh", ewise_tanh);
  m.def("ewise_strided", ewise_strided);
  m.def("scalar_strided", scalar_strided);
  m.def("unary_strided", unary_strided);

  m.def("matmul", matmul, py::arg("a"), py::arg("b"), py::arg("out"), py::arg("m"), py::arg("n"), py::arg("p"),
        py::arg("trans_a") = false, py::arg("trans_b") = false);
  m.def("matmul_batched", matmul_batched);
  m.def("matmul_tiled", matmul_tiled);
  m.def("reduce_max", reduce_max);
  m.def("reduce_sum", reduce_sum);
  m.def("reduce_logsumexp", reduce_logsumexp);
  m.def("softmax_xent_grad", softmax_xent_grad);
  m.def("take_rows", take_rows);
  m.def("scatter_add_rows", scatter_add_rows);
  m.def("take_along_rows", take_along_rows);
  m.def("scatter_along_rows", scatter_along_rows);
  m.def("attention_forward", attention_forward);
  m.def("attention_backward", attention_backward);
  m.def("layernorm_forward", layernorm_forward);
  m.def("layernorm_backward", layernorm_backward);

  m.def("memory_stats", memory_stats);
  m.def("reset_peak_memory_stats", reset_peak_memory_stats);
  m.def("set_memory_limit", set_memory_limit);
  m.def("empty_cache", empty_cache);
  m.def("set_cache_limit", set_cache_limit);

  // Extras beyond the contract (diagnostics for tests and benchmarks).
  choose_kernel();
  choose_bf16_dot();
  choose_vector_kernels();
  pthread_atfork(nullptr, nullptr, [] { g_forked.store(true); });
  m.def("matmul_kernel", []() { return std::string(g_kernel->name); },
        "the matmul micro-kernel in use: avx512, avx2 or generic");
  m.def("set_matmul_kernel", set_matmul_kernel, "force a matmul micro-kernel (avx512, avx2, generic)");
  m.def("matmul_bf16_dot", []() { return g_bf16_dot; },
        "whether the AVX512-BF16 dot-product kernel for bfloat16 matmuls (VDPBF16PS on pairs of k, float32 "
        "accumulators, denormals flushed) is switched on; bfloat16 products use it while the avx512 kernel is "
        "selected.  Always false where the CPU has no AVX512-BF16.");
  m.def("set_matmul_bf16_dot", set_matmul_bf16_dot, py::arg("enabled"),
        "switch the bfloat16 dot-product kernel on (the default where the CPU has AVX512-BF16; ValueError where "
        "it has not) or off (bfloat16 is then widened to float32 while packing, as float16 is).  Used only while "
        "the avx512 kernel is selected.  NEEDLE_CPU_MATMUL_BF16_DOT=0 switches it off at import.");
  m.def("num_threads", num_threads, "threads used by matmul (OMP_NUM_THREADS, default: all cores)");
  m.def("vector_isa", []() { return std::string(g_vector->name); },
        "the instruction set of the exp/log/tanh/sum/max kernels in use: avx512, avx2 or generic");
  m.def("set_vector_isa", set_vector_isa, "force the exp/log/tanh/sum/max kernels' instruction set");
}
