// array.h -- Array, the module's buffer: `size` elements of one dtype, counted by the memory statistics from
// construction until the Python object dies; the allocator's policy behind it (C library heap for small buffers,
// allocator.h's arena of mapped pages for the others: what stays resident for reuse, and for how long); the
// contract's memory functions (memory_stats, reset_peak_memory_stats, set_memory_limit, set_cache_limit,
// empty_cache); and the dtype checks on Arrays that kernels share (same_float_dtype, require_float32).
//
// Python owns shape / strides / offset: an Array never knows them.
#pragma once

#include "allocator.h"
#include "common.h"
#include "dtypes.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <pthread.h>
#include <unistd.h>

namespace needle {
namespace cpu {

// Raised by the allocator; translated to Python's MemoryError (with this message) in the module definition.
class NeedleMemoryError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Accounting counts the *requested* bytes, size * itemsize, of every live Array: not the bytes the allocator
// really reserves (rounded up to a multiple of ALIGNMENT, or to whole pages).  So current_bytes is exactly the sum
// of the sizes of live Arrays, which is what tests and users can predict.
//
// Where the bytes come from.  Buffers below ARENA_THRESHOLD (64 KiB: biases, row statistics, small reductions) come
// from the C library (aligned_alloc), where an allocation is a few tens of nanoseconds (the arena's take a few
// hundred, nothing beside the work on 64 KiB, and round to 4 KiB pages, which small buffers would waste).  The
// others, whole pages, come from allocator.h's arena: segments of address space mapped from the kernel, in which a
// block is carved from the best-fitting free range and a freed block joins its free neighbours, so memory one size
// gave back serves a request of another.  The C library's heap cannot do that for us: glibc keeps freed blocks in
// its heap (raising its own mmap threshold up to 32 MiB as it frees), a freed heap block below a live one never
// goes back, and small arrays allocated between large ones pin them (measured: three rounds of 200 x 4 MiB with a
// small live array after each left 1.4 GB resident with 0 bytes held).  The small buffers' heap is apart from the
// arena, so they never pin its free pages.  The arena's segments ask for transparent huge pages (first touching 2
// MiB faults once, not 512 times); measured, one arena for every size kept resident memory lower than a second
// arena for blocks of 4 MiB and more did (each arena's free pages could serve only its own sizes).
//
// What stays resident.  A fresh page faults in on first touch (the kernel zeroes it), about one pass over the
// buffer.  A training step frees and asks again for the same sizes every step, so a freed block stays *dirty*
// (its pages resident, reused without a fault) when it is worth keeping; otherwise its pages go back to the kernel
// at once (madvise(MADV_DONTNEED); a segment with nothing live and nothing dirty is unmapped).  Three rules:
//   - A size recurs once it is asked for again after a block of that size went back to the kernel.  Until then
//     a freed block of that size goes back at once: `del` of a big array lowers resident memory right away,
//     while a training step's sizes recur within its first step or two and are kept from then on.
//   - Live + dirty bytes stay within 1.15 x the high-water mark (the most bytes ever live at once) + 32 MiB, the
//     dirty ranges freed longest ago going first (set_cache_limit bounds the dirty bytes further; 0: none kept;
//     under set_memory_limit never more than the limit).  Because free ranges split and coalesce, what a step
//     frees early serves what it asks for later, whatever the size (an earlier cache of exact sizes kept the freed
//     blocks of one size resident beside new blocks of another); what the bound still has to hold is
//     fragmentation: holes between live blocks too small for the next request.
//   - Dirty memory not reused for longer than a step goes back (the *hold*).  A step is not announced, so the
//     allocator measures it: the hold is twice the longest interval it saw, among the last thousand or so reuses,
//     between a block's free and the reuse of its pages or the next request of its size (one step for what a step
//     asks for once, as Adam's temporaries), within [1 s, 10 s] (at least 1 s: before the first reuse there is
//     nothing to go by, and a step of up to half a second keeps its blocks from the start; at most 10 s: after a
//     longer pause, an evaluation say, the next step faults its pages in once).  A dirty range older than the hold is
//     released by the trimmer, a thread that sleeps until the oldest range's hold runs out: so after a step's last
//     free, or a burst of allocations nobody repeats, resident memory falls back to what is live within seconds,
//     without anybody calling in.  The thread only takes the allocator's mutex and calls madvise/munmap; it never
//     touches Python, so it needs the GIL for nothing and the interpreter's shutdown does not concern it (it is
//     detached, and the state it reads is never destroyed).  fork(): pthread_atfork handlers take the mutex around
//     the fork, so the child never inherits it locked by a thread it does not have, and the child starts a trimmer
//     of its own when it first keeps a block.  (The cache's pages that share a 2 MiB page with live bytes stay
//     resident when it releases them: the kernel's khugepaged would collapse that partly resident huge page,
//     filling them in again later, which memory_stats cannot see; allocator.h's release_pages.)
// The dirty bytes are resident memory that current_bytes does not count, so they are reported:
// memory_stats()["cached_bytes"] (and "reserved_bytes" = current_bytes + cached_bytes, as CUDA's reserved bytes
// count live plus cached blocks: the resident memory the allocator answers for); empty_cache() releases them,
// as does an allocation the kernel refuses.
constexpr size_t ARENA_THRESHOLD = size_t(64) << 10;
constexpr size_t CACHE_SLACK_BYTES = size_t(32) << 20;  // the bound's + 32 MiB
constexpr size_t MAX_TRACKED_SIZES = 4096;  // sizes remembered (returned, last freed); forgotten all at once beyond
constexpr size_t AUTO_CACHE = std::numeric_limits<size_t>::max();
constexpr size_t HOLD_WINDOW = 1024;  // reuses per window of the hold's measurement (the last two windows count)
constexpr Clock::duration MIN_HOLD = std::chrono::seconds(1);
constexpr Clock::duration MAX_HOLD = std::chrono::seconds(10);

struct MemoryStats {
  std::mutex mu;
  size_t current_bytes = 0;
  size_t peak_bytes = 0;
  size_t allocations = 0;  // number of live Arrays
  size_t limit_bytes = 0;  // 0 = no limit
  size_t high_water_bytes = 0;       // the most bytes ever live at once (never reset)
  size_t cache_limit = AUTO_CACHE;   // set_cache_limit's bytes, or AUTO_CACHE: the bound in cache_capacity
  size_t cached_bytes_at_peak = 0;   // cached bytes when peak_bytes was last raised (or reset)
  Arena pages{true};                 // the blocks of ARENA_THRESHOLD bytes and more, on huge pages where THP allows
  std::unordered_set<size_t> returned;   // sizes of blocks that went back to the kernel (not yet recurring)
  std::unordered_set<size_t> recurring;  // sizes asked for again after that: their freed blocks are kept
  std::unordered_map<size_t, Clock::time_point> last_freed;  // per recurring size: its latest free
  Clock::duration reuse_window[2] = {};  // the longest reuse interval of this window and of the one before
  size_t reuses_in_window = 0;
  std::condition_variable* trimmer_cv = new std::condition_variable();  // replaced in a forked child
  bool trimmer_started = false;
  bool trimmer_idle = false;  // waiting with no deadline: nothing was dirty
  size_t cached_bytes() const { return pages.dirty_bytes(); }
};

// Never destroyed, so Arrays that die during interpreter shutdown (and the trimmer) still find it.
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

// How long a dirty range may wait for reuse: twice the longest reuse interval of the last two windows, within
// [MIN_HOLD, MAX_HOLD].  Caller holds s.mu.
static Clock::duration hold(const MemoryStats& s) {
  return std::clamp(2 * std::max(s.reuse_window[0], s.reuse_window[1]), MIN_HOLD, MAX_HOLD);
}

// One reuse interval seen (a dirty range's age when its pages were reused, or the time since a size's last free
// when it is asked for again).  Caller holds s.mu.
static void saw_reuse(MemoryStats& s, Clock::duration interval) {
  if (interval > MAX_HOLD) return;  // an idle spell, not a step
  if (++s.reuses_in_window > HOLD_WINDOW) {
    s.reuse_window[1] = s.reuse_window[0];
    s.reuse_window[0] = Clock::duration::zero();
    s.reuses_in_window = 1;
  }
  s.reuse_window[0] = std::max(s.reuse_window[0], interval);
}

// Releases dirty ranges until at most `cap` bytes are dirty, those freed longest ago first.  Caller holds s.mu.
static void trim_cache(MemoryStats& s, size_t cap) {
  while (s.cached_bytes() > cap)
    if (s.pages.release_oldest(s.cached_bytes() - cap, page_size()) == 0) break;
}

// Releases every dirty range.  Caller holds s.mu.
static void release_cache(MemoryStats& s) {
  s.pages.release_before(Clock::time_point::max());
}

// How many bytes may stay dirty now: 1.15 x the high-water mark + 32 MiB, less what is live (and `more_live`
// bytes about to be), so that live plus dirty bytes stay within that bound; or set_cache_limit's bytes; never more
// than set_memory_limit's.  Caller holds s.mu.
static size_t cache_capacity(const MemoryStats& s, size_t more_live = 0) {
  size_t cap = s.cache_limit;
  if (cap == AUTO_CACHE) {
    const size_t high_water = std::max(s.high_water_bytes, s.current_bytes + more_live);
    const size_t bound = high_water + high_water / 100 * 15 + CACHE_SLACK_BYTES;
    cap = bound - std::min(bound, s.current_bytes + more_live);
  }
  if (s.limit_bytes != 0) cap = std::min(cap, s.limit_bytes);
  return cap;
}

// The trimmer's loop: sleep until the oldest dirty range has waited its hold, release what has, again.
static void trim_forever() {
  MemoryStats& s = stats();
  std::unique_lock<std::mutex> lock(s.mu);
  for (;;) {
    const Clock::time_point oldest = s.pages.oldest_dirty();
    if (oldest == Clock::time_point::max()) {
      s.trimmer_idle = true;
      s.trimmer_cv->wait(lock);  // until a block is kept (put_pages notifies)
      s.trimmer_idle = false;
      continue;
    }
    const Clock::time_point now = Clock::now();
    if (now < oldest + hold(s)) {
      s.trimmer_cv->wait_until(lock, oldest + hold(s));
      continue;
    }
    s.pages.release_before(now - hold(s));
  }
}

// Starts the trimmer on the first block kept, or wakes it if nothing was dirty.  Caller holds s.mu.
static void wake_trimmer(MemoryStats& s) {
  if (s.trimmer_started) {
    if (s.trimmer_idle) s.trimmer_cv->notify_one();
    return;
  }
  static const bool fork_handlers = [] {
    pthread_atfork([] { stats().mu.lock(); }, [] { stats().mu.unlock(); },
                   [] {  // the child: no trimmer thread, and a condition variable no thread of its waits on
                     MemoryStats& c = stats();
                     c.trimmer_cv = new std::condition_variable();  // the parent's may count its waiter: leaked
                     c.trimmer_started = c.trimmer_idle = false;
                     c.mu.unlock();
                   });
    return true;
  }();
  (void)fork_handlers;
  try {
    std::thread(trim_forever).detach();
    s.trimmer_started = true;
  } catch (const std::system_error&) {
    // no thread to be had: dirty memory then goes back only under the bound, empty_cache() or a refused mapping
  }
}

// A block of `bytes` (page-rounded) from the arena; after a refused mapping, again once every dirty
// range is released; nullptr if even that fails.  Caller holds s.mu.
static void* get_pages(MemoryStats& s, size_t bytes) {
  const Clock::time_point now = Clock::now();
  if (s.returned.erase(bytes) != 0) s.recurring.insert(bytes);  // asked for again: keep this size from now on
  const auto last = s.last_freed.find(bytes);
  if (last != s.last_freed.end()) saw_reuse(s, now - last->second);
  Clock::duration reused;
  bool fresh;
  void* p = s.pages.take(bytes, now, &reused, &fresh);
  if (p == nullptr && s.cached_bytes() != 0) {
    release_cache(s);
    p = s.pages.take(bytes, now, &reused, &fresh);
  }
  if (reused != Clock::duration::zero()) saw_reuse(s, reused);
  // Fresh pages are about to become resident: release dirty ones first, so that resident memory (live + dirty)
  // never passes the bound, not even until the next free.
  if (p != nullptr && fresh) trim_cache(s, cache_capacity(s, bytes));
  return p;
}

// A block whose Array died: kept dirty if its size recurs and it fits under the bound (releasing the oldest
// dirty ranges to make room), else released at once (and its size remembered, so that a later request of it makes
// the size recurring).  Caller holds s.mu.
static void put_pages(MemoryStats& s, void* ptr, size_t bytes) {
  const Clock::time_point now = Clock::now();
  const size_t cap = cache_capacity(s);
  const bool keep = bytes <= cap && s.recurring.count(bytes) != 0;
  if (!keep) {
    if (s.returned.size() >= MAX_TRACKED_SIZES) s.returned.clear();
    s.returned.insert(bytes);
  }
  if (s.last_freed.size() >= MAX_TRACKED_SIZES) s.last_freed.clear();
  s.last_freed[bytes] = now;
  s.pages.give(ptr, bytes, keep, now);
  if (keep) {
    trim_cache(s, cap);
    wake_trimmer(s);
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
    acquire_block();
  }
  // Its own block, from the allocator (the constructor's; place_in_arena's when the arena cannot be made).
  void acquire_block() {
    const size_t bytes = size * itemsize;
    const size_t alloc_bytes = std::max(ALIGNMENT, (bytes + ALIGNMENT - 1) / ALIGNMENT * ALIGNMENT);
    MemoryStats& s = stats();
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.limit_bytes != 0 && bytes > s.limit_bytes - std::min(s.limit_bytes, s.current_bytes)) {
      std::ostringstream msg;
      msg << "needle cpu: cannot allocate " << bytes << " bytes: " << s.current_bytes << " bytes held, limit "
          << s.limit_bytes << " bytes";
      throw NeedleMemoryError(msg.str());
    }
    if (alloc_bytes >= ARENA_THRESHOLD) {
      const size_t page = page_size();
      mapped_bytes = (alloc_bytes + page - 1) / page * page;
      ptr = static_cast<scalar_t*>(get_pages(s, mapped_bytes));  // page-aligned, so ALIGNMENT-aligned
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
      s.cached_bytes_at_peak = s.cached_bytes();
    }
    s.high_water_bytes = std::max(s.high_water_bytes, s.current_bytes);
    s.allocations += 1;
    owns = true;
  }
  struct Unallocated {};  // an array of no bytes yet: alias_into gives it its place (place_in_arena)
  Array(size_t n, DType dt, Unallocated) : size(n), dtype(dt), itemsize(info(dt).itemsize), owns(false) {}
  ~Array() {
    if (owns) release_block();  // (an alias owns nothing: its arena is released with `arena`)
  }
  // ndl.jit.capture's static memory plan (place_in_arena): this array, holding no block of its own, becomes
  // `size` elements at `offset` bytes into `arena_array`, which it keeps alive.
  void alias_into(py::object arena_array, size_t offset) {
    const Array& into = arena_array.cast<const Array&>();
    const size_t bytes = size * itemsize;
    if (owns || !arena.is_none() || !into.arena.is_none() || &into == this) {
      throw std::invalid_argument("Array.alias_into: only an array with no bytes of its own is placed, once, into "
                                  "an arena that is not an alias itself");
    }
    if (offset % ALIGNMENT != 0 || offset > into.size * into.itemsize ||
        bytes > into.size * into.itemsize - offset) {
      std::ostringstream msg;
      msg << "Array.alias_into: " << bytes << " bytes at offset " << offset << " do not fit an arena of "
          << into.size * into.itemsize << " bytes (offsets are multiples of " << ALIGNMENT << ")";
      throw std::invalid_argument(msg.str());
    }
    ptr = reinterpret_cast<scalar_t*>(reinterpret_cast<char*>(into.ptr) + offset);
    arena = std::move(arena_array);
  }
  bool is_alias() const { return !arena.is_none(); }
  // Its own block given back (place_in_arena, before the arena it moves into is allocated): no bytes until then.
  void give_back_block() {
    if (!owns) return;
    release_block();
    owns = false;
    ptr = nullptr;
    mapped_bytes = 0;
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
  size_t mapped_bytes = 0;  // bytes of ptr's block in an arena (whole pages); 0 if ptr came from aligned_alloc
  py::object arena = py::none();  // an alias's arena (alias_into); None for an array that owns its block
  bool owns = true;  // whether ptr is this array's own block (false: an alias, or not placed yet)

 private:
  void release_block() {
    MemoryStats& s = stats();
    std::lock_guard<std::mutex> lock(s.mu);
    s.current_bytes -= size * itemsize;
    if (mapped_bytes != 0) {
      put_pages(s, ptr, mapped_bytes);
    } else {
      std::free(ptr);
    }
    s.allocations -= 1;
  }
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
  d["cached_bytes"] = s.cached_bytes();
  d["reserved_bytes"] = s.current_bytes + s.cached_bytes();
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
  s.cached_bytes_at_peak = s.cached_bytes();
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
