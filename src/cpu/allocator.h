// allocator.h -- Arena: the pages behind the CPU backend's buffers of 64 KiB and more.  An arena maps segments
// of address space from the kernel and carves blocks out of them: a block comes from the best-fitting free range
// (split, the rest stays free), and a freed block joins its free neighbours (coalesced), so the bytes one size
// gave back serve the next request of any size.  A free range is either *dirty* (its pages are still resident:
// reused without a page fault) or *clean* (released with madvise(MADV_DONTNEED): address space only, zero pages
// that fault in on first touch); requests take a dirty range before a clean one.  A segment with nothing live and
// nothing dirty is unmapped.  Which freed blocks stay dirty, and for how long, is array.h's policy: this file only
// keeps the ranges.  Not thread-safe: the caller holds the allocator's mutex (array.h's MemoryStats::mu).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <sys/mman.h>

namespace needle {
namespace cpu {

using Clock = std::chrono::steady_clock;
constexpr size_t HUGE_PAGE = size_t(2) << 20;
// Free ranges never merge across segments, so a request larger than every segment's free range faults fresh pages
// in, however many bytes are free.  Address space is cheap (mapped, not resident: a page costs memory only once
// touched), so a segment is large: one of 1 GiB holds every buffer of a step of a few hundred MB, and what the step
// freed coalesces into ranges that serve its largest request (measured at the benchmark model with gc "all": with
// 64 MiB segments the 156 MiB logits faulted in anew every step, about 80 faults a step; with 1 GiB, none).
constexpr size_t SEGMENT_BYTES = size_t(1) << 30;  // a bigger request gets a segment of its own size
constexpr size_t SMALL_SEGMENT_BYTES = size_t(64) << 20;  // tried when the kernel refuses SEGMENT_BYTES (strict overcommit)

class Arena {
 public:
  // huge_pages: ask for transparent huge pages on every segment (madvise(MADV_HUGEPAGE)), as NumPy does for its
  // large arrays: first touching 2 MiB faults once instead of 512 times.  Only a hint: off where THP is "never".
  explicit Arena(bool huge_pages) : huge_(huge_pages && huge_pages_possible()) {}

  // A block of `bytes` (a multiple of the page size, so it is 64-byte aligned): carved from the smallest dirty
  // range that holds it, else from the largest dirty range that does with its clean neighbours, else from the
  // smallest clean one, else from a new segment; nullptr if the kernel refuses one.  *reused is set to how long the
  // dirty range it came from had been free (zero if it was clean); *fresh to whether any of it was clean (those
  // pages fault in on first touch).
  void* take(size_t bytes, Clock::time_point now, Clock::duration* reused, bool* fresh) {
    *reused = Clock::duration::zero();
    *fresh = true;
    auto it = dirty_by_size_.lower_bound({bytes, 0});
    if (it == dirty_by_size_.end()) {
      if (void* p = take_dirty_and_clean(bytes, now, reused)) return p;
      it = clean_by_size_.lower_bound({bytes, 0});
      if (it == clean_by_size_.end()) {
        if (!map_segment(bytes, now)) return nullptr;
        it = clean_by_size_.lower_bound({bytes, 0});
      }
    }
    const uintptr_t addr = it->second;
    const Range r = free_.at(addr);
    remove(free_.find(addr));
    if (r.dirty) *reused = now - r.freed_at;
    *fresh = !r.dirty;
    if (r.bytes > bytes) add(addr + bytes, {r.bytes - bytes, r.dirty, r.freed_at, r.segment});
    segments_.at(r.segment).live += bytes;
    return reinterpret_cast<void*>(addr);
  }

  // Takes back a block take() gave: kept dirty (resident, for reuse) or, with keep false, released at once.
  void give(void* ptr, size_t bytes, bool keep, Clock::time_point now) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(ptr);
    const uintptr_t segment = std::prev(segments_.upper_bound(addr))->first;
    segments_.at(segment).live -= bytes;
    add_coalesced(addr, {bytes, keep, now, segment});
    if (!keep) release_pages(addr, bytes, false);  // every page: `del` lowers resident memory by what it freed
    unmap_if_unused(segment);
  }

  // Releases up to `bytes` (rounded up to pages) of the dirty range freed longest ago; returns the bytes released
  // (0: nothing is dirty).  The range's upper end goes, so what stays dirty is where the next block is carved.
  size_t release_oldest(size_t bytes, size_t page) {
    auto oldest = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->second.dirty && (oldest == free_.end() || it->second.freed_at < oldest->second.freed_at)) oldest = it;
    if (oldest == free_.end()) return 0;
    const uintptr_t addr = oldest->first;
    const Range r = oldest->second;
    const size_t n = std::min(r.bytes, (bytes + page - 1) / page * page);
    remove(oldest);
    if (r.bytes > n) add(addr, {r.bytes - n, true, r.freed_at, r.segment});
    add_coalesced(addr + r.bytes - n, {n, false, r.freed_at, r.segment});
    release_pages(addr + r.bytes - n, n, true);
    unmap_if_unused(r.segment);
    return n;
  }

  // Releases every dirty range freed at or before `before`; returns the bytes released.
  size_t release_before(Clock::time_point before) {
    std::vector<uintptr_t> due;
    for (const auto& [addr, r] : free_)
      if (r.dirty && r.freed_at <= before) due.push_back(addr);
    size_t released = 0;
    for (uintptr_t addr : due) {  // releasing merges clean ranges only: a dirty one's address stays valid
      const Range r = free_.at(addr);
      remove(free_.find(addr));
      add_coalesced(addr, {r.bytes, false, r.freed_at, r.segment});
      release_pages(addr, r.bytes, true);
      unmap_if_unused(r.segment);
      released += r.bytes;
    }
    return released;
  }

  // When the dirty range freed longest ago was freed; time_point::max() when nothing is dirty.
  Clock::time_point oldest_dirty() const {
    Clock::time_point t = Clock::time_point::max();
    for (const auto& [addr, r] : free_)
      if (r.dirty) t = std::min(t, r.freed_at);
    return t;
  }

  size_t dirty_bytes() const { return dirty_; }

 private:
  struct Segment {
    size_t bytes;
    size_t live = 0;   // bytes of blocks given out
    size_t dirty = 0;  // bytes of its dirty free ranges
  };
  struct Range {
    size_t bytes;
    bool dirty;
    Clock::time_point freed_at;  // of a merged range: the latest of its parts
    uintptr_t segment;           // the segment's start: ranges never merge across segments
  };
  using BySize = std::set<std::pair<size_t, uintptr_t>>;  // (bytes, address): best fit, lowest address first

  void add(uintptr_t addr, const Range& r) {
    free_.emplace(addr, r);
    (r.dirty ? dirty_by_size_ : clean_by_size_).insert({r.bytes, addr});
    if (r.dirty) {
      dirty_ += r.bytes;
      segments_.at(r.segment).dirty += r.bytes;
    }
  }

  void remove(std::map<uintptr_t, Range>::iterator it) {
    const Range& r = it->second;
    (r.dirty ? dirty_by_size_ : clean_by_size_).erase({r.bytes, it->first});
    if (r.dirty) {
      dirty_ -= r.bytes;
      segments_.at(r.segment).dirty -= r.bytes;
    }
    free_.erase(it);
  }

  // The free range just before `addr` in the same segment and ending there, if it is clean; else free_.end().
  std::map<uintptr_t, Range>::iterator clean_before(uintptr_t addr, uintptr_t segment) {
    auto after = free_.lower_bound(addr);
    if (after == free_.begin()) return free_.end();
    auto prev = std::prev(after);
    const Range& r = prev->second;
    return prev->first + r.bytes == addr && r.segment == segment && !r.dirty ? prev : free_.end();
  }

  // The free range starting at `addr` in the same segment, if it is clean; else free_.end().
  std::map<uintptr_t, Range>::iterator clean_at(uintptr_t addr, uintptr_t segment) {
    auto it = free_.find(addr);
    return it != free_.end() && it->second.segment == segment && !it->second.dirty ? it : free_.end();
  }

  // When no dirty range holds `bytes`: the largest dirty range that does with the clean ranges beside it (dirty
  // and clean neighbours never merge, so without this a block would fault all its pages in while resident free
  // pages lie next to the clean ones it takes), the rest taken from the clean range after it, then the one before.
  // nullptr if none does.
  void* take_dirty_and_clean(size_t bytes, Clock::time_point now, Clock::duration* reused) {
    for (auto d = dirty_by_size_.rbegin(); d != dirty_by_size_.rend(); ++d) {
      const uintptr_t addr = d->second;
      const Range r = free_.at(addr);
      auto before = clean_before(addr, r.segment), after = clean_at(addr + r.bytes, r.segment);
      const size_t from_after = after == free_.end() ? 0 : std::min(after->second.bytes, bytes - r.bytes);
      const size_t from_before = bytes - r.bytes - from_after;
      if (from_before > (before == free_.end() ? 0 : before->second.bytes)) continue;
      const uintptr_t start = addr - from_before;
      if (after != free_.end()) {
        const Range a = after->second;
        remove(after);
        if (a.bytes > from_after) add(addr + r.bytes + from_after, {a.bytes - from_after, false, a.freed_at, a.segment});
      }
      if (from_before != 0) {
        const uintptr_t b_addr = before->first;
        const Range b = before->second;
        remove(before);
        if (b.bytes > from_before) add(b_addr, {b.bytes - from_before, false, b.freed_at, b.segment});
      }
      remove(free_.find(addr));
      *reused = now - r.freed_at;
      segments_.at(r.segment).live += bytes;
      return reinterpret_cast<void*>(start);
    }
    return nullptr;
  }

  // Gives the pages of [addr, addr + bytes), just made part of a clean range, back to the kernel: every one, or with
  // `shared_kept` (the cache's releases) not those in a 2 MiB page that also holds live bytes.  With huge pages the
  // kernel's khugepaged fills such pages in again anyway (it collapses a partly resident 2 MiB range into one huge
  // page), later, unasked and unseen by memory_stats: resident memory that grew under a step that allocated nothing
  // (measured: +1.5 MB over 200 replays of a captured step, issue 49, as the cache it had left went back).  So the
  // cache keeps them, until the live bytes beside them are freed.  A block freed for good gives every page back at
  // once all the same (`del` lowers resident memory by what it freed; among small live blocks, keeping them held a
  // quarter of what was freed), and khugepaged may fill up to 2 MiB back at either end, within minutes.  (A huge
  // page shared with free bytes only, dirty ones, loses its clean part at once: the dirty part goes within the hold.)
  void release_pages(uintptr_t addr, size_t bytes, bool shared_kept) {
    uintptr_t start = addr, end = addr + bytes;
    if (huge_ && shared_kept) {
      const auto joined = std::prev(free_.upper_bound(addr));  // the clean range [addr, addr + bytes) is part of
      const uintptr_t first = joined->first, last = first + joined->second.bytes;
      start = std::max(all_free(round_down(first), first) ? first : round_up(first), round_down(addr));
      end = std::min(all_free(last, round_up(last)) ? last : round_down(last), round_up(addr + bytes));
    }
    if (start < end) madvise(reinterpret_cast<void*>(start), end - start, MADV_DONTNEED);
  }

  // Whether [from, to) is all free ranges, side by side (no live byte in it).
  bool all_free(uintptr_t from, uintptr_t to) const {
    auto it = free_.upper_bound(from);
    if (it == free_.begin()) return from == to;
    for (--it; from < to; ++it) {
      if (it == free_.end() || it->first > from || it->first + it->second.bytes <= from) return false;
      from = it->first + it->second.bytes;
    }
    return true;
  }

  static bool huge_pages_possible() {
    std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string modes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    return modes.find("[never]") == std::string::npos;  // (no such file: not Linux, where MADV_HUGEPAGE is absent)
  }
  static uintptr_t round_down(uintptr_t a) { return a & ~(HUGE_PAGE - 1); }
  static uintptr_t round_up(uintptr_t a) { return (a + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1); }

  // Adds a free range, merged with the free neighbours of its own state in its segment.
  void add_coalesced(uintptr_t addr, Range r) {
    auto next = free_.find(addr + r.bytes);
    if (next != free_.end() && next->second.segment == r.segment && next->second.dirty == r.dirty) {
      r.bytes += next->second.bytes;
      r.freed_at = std::max(r.freed_at, next->second.freed_at);
      remove(next);
    }
    auto after = free_.lower_bound(addr);
    if (after != free_.begin()) {
      auto prev = std::prev(after);
      if (prev->first + prev->second.bytes == addr && prev->second.segment == r.segment &&
          prev->second.dirty == r.dirty) {
        addr = prev->first;
        r.bytes += prev->second.bytes;
        r.freed_at = std::max(r.freed_at, prev->second.freed_at);
        remove(prev);
      }
    }
    add(addr, r);
  }

  // A new segment of at least `bytes`, all of it one clean range, starting on a 2 MiB boundary (map a little
  // more, unmap the ends) so that all of it can be huge pages.  SEGMENT_BYTES, or where the kernel refuses that
  // much address space, SMALL_SEGMENT_BYTES.
  bool map_segment(size_t bytes, Clock::time_point now) {
    const size_t rounded = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    size_t seg = std::max(SEGMENT_BYTES, rounded);
    void* p = mmap(nullptr, seg + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED && rounded < SEGMENT_BYTES) {
      seg = std::max(SMALL_SEGMENT_BYTES, rounded);
      p = mmap(nullptr, seg + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    if (p == MAP_FAILED) return false;
    const uintptr_t raw = reinterpret_cast<uintptr_t>(p);
    const uintptr_t start = (raw + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    if (start > raw) munmap(p, start - raw);
    if (raw + HUGE_PAGE > start) munmap(reinterpret_cast<void*>(start + seg), raw + HUGE_PAGE - start);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (huge_) madvise(reinterpret_cast<void*>(start), seg, MADV_HUGEPAGE);
#endif
    segments_.emplace(start, Segment{seg});
    add(start, {seg, false, now, start});
    return true;
  }

  // Unmaps a segment with no live block and no dirty range (so it is one clean range, or several split by nothing).
  void unmap_if_unused(uintptr_t segment) {
    const Segment& s = segments_.at(segment);
    if (s.live != 0 || s.dirty != 0) return;
    const size_t bytes = s.bytes;
    for (auto it = free_.lower_bound(segment); it != free_.end() && it->first < segment + bytes;) remove(it++);
    munmap(reinterpret_cast<void*>(segment), bytes);
    segments_.erase(segment);
  }

  bool huge_;
  std::map<uintptr_t, Segment> segments_;  // by start address
  std::map<uintptr_t, Range> free_;        // every free range, by start address
  BySize dirty_by_size_, clean_by_size_;
  size_t dirty_ = 0;  // bytes of all dirty ranges
};

}  // namespace cpu
}  // namespace needle
