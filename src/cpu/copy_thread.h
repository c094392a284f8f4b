// copy_thread.h -- a copy thread: host copies that run beside the compute, as a CUDA copy stream's run beside
// kernels.  offload.py parks activations in host memory and fetches them back; on this backend a "device" buffer
// and a host buffer are both main memory, so each copy is a memcpy, and done by the thread that computes, nothing
// runs beside it.  Here one worker thread does them, in the order they were issued (like a stream), without
// Python's GIL: the computing thread queues a copy and goes on with the next ops while the other core copies.
//
// The contract (python/needle/backend_ndarray/copy_thread.py): the caller leaves both buffers untouched until it
// has waited for the copy's ticket.  The copy holds them alive itself (a reference to each Python object) until it
// is done and a later call, holding the GIL, sees that it is: the worker never touches Python objects, so it cannot
// let go of them.  Tickets count up from 1; waiting for one waits for every copy issued before it too, and waiting
// for one never issued is an error (it would wait forever).  Reference: a plain std::memcpy (what to_numpy_into /
// from_numpy do for a compact array).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "array.h"
#include "common.h"

namespace needle {
namespace cpu {

class CopyThread {
 public:
  // Queue a copy of `bytes` bytes from `src` to `dst`, holding `owners` (the objects whose memory they are) until
  // it is done; its ticket.  Called with the GIL held.
  uint64_t submit(void* dst, const void* src, size_t bytes, py::object owners) {
    uint64_t ticket;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!started_) {  // started on first use; detached: the process may end with it idle, never mid-copy
        std::thread([this] { run(); }).detach();
        started_ = true;
      }
      ticket = ++issued_;
      queue_.push_back({dst, src, bytes, ticket});
      work_.notify_one();
    }
    release_done();
    held_.push_back({ticket, std::move(owners)});
    return ticket;
  }

  // Block, without the GIL, until the copy `ticket` (and every one before it) is done; then let go of what the
  // copies done hold.  Called with the GIL held.
  void wait(uint64_t ticket) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (ticket > issued_) {
        fail("copy_thread_wait: ticket " + std::to_string(ticket) + " was never issued (the last one issued is " +
             std::to_string(issued_) + ")");
      }
    }
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(mutex_);
      done_cv_.wait(lock, [&] { return done_ >= ticket; });
    }
    release_done();
  }

 private:
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
    uint64_t ticket;
  };

  void run() {
    for (;;) {
      std::unique_lock<std::mutex> lock(mutex_);
      work_.wait(lock, [&] { return !queue_.empty(); });
      Copy copy = queue_.front();
      queue_.pop_front();
      lock.unlock();
      if (copy.bytes) std::memcpy(copy.dst, copy.src, copy.bytes);
      lock.lock();
      done_ = copy.ticket;
      done_cv_.notify_all();
    }
  }

  // Drops the owners of the copies done (the oldest first: copies finish in issue order).  With the GIL held.
  void release_done() {
    uint64_t done;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done = done_;
    }
    while (!held_.empty() && held_.front().first <= done) held_.pop_front();
  }

  std::mutex mutex_;
  std::condition_variable work_, done_cv_;
  std::deque<Copy> queue_;
  uint64_t issued_ = 0, done_ = 0;
  bool started_ = false;
  std::deque<std::pair<uint64_t, py::object>> held_;  // (ticket, what its copy holds alive); only with the GIL
};

// The module's one copy thread (never destroyed: its worker may outlive static destruction at exit).
static CopyThread& copy_thread() {
  static CopyThread* thread = new CopyThread();
  return *thread;
}

// The bindings' checks: a C-contiguous host array holding exactly the buffer's bytes.
static void check_host_array(const char* fn, const Array& a, const py::array& host, bool writes_host) {
  if (!(host.flags() & py::array::c_style) || (writes_host && !host.writeable())) {
    throw py::type_error(std::string(fn) + ": the host array must be C-contiguous" +
                         (writes_host ? " and writeable" : ""));
  }
  check_size(fn, "the host array's bytes", static_cast<size_t>(host.nbytes()), a.size * a.itemsize);
}

// The Python objects of a buffer and a host array, for the copy between them to hold.  `buffer` came from Python,
// so pybind11 finds its object (`reference`: never a new owner).
static py::object owners(const Array& buffer, const py::array& host) {
  return py::make_tuple(py::cast(buffer, py::return_value_policy::reference), host);
}

// Queue a copy of the whole buffer `a` into `out` (a host array of its bytes); its ticket.
static uint64_t copy_thread_to_host(const Array& a, py::array out) {
  check_host_array("copy_thread_to_host", a, out, true);
  return copy_thread().submit(out.mutable_data(), a.ptr, a.size * a.itemsize, owners(a, out));
}

// Queue a copy of `host` (a host array of out's bytes) into the whole buffer `out`; its ticket.
static uint64_t copy_thread_to_device(py::array host, Array& out) {
  check_host_array("copy_thread_to_device", out, host, false);
  return copy_thread().submit(out.ptr, host.data(), out.size * out.itemsize, owners(out, host));
}

// Block (releasing the GIL while it waits) until copy `ticket` and those before it are done.
static void copy_thread_wait(uint64_t ticket) { copy_thread().wait(ticket); }

}  // namespace cpu
}  // namespace needle
