// host_copy.cuh -- copies between device buffers and the host: to_numpy / from_numpy (synchronous), and for
// offloaded optimizer state, page-locked (pinned) numpy arrays copied asynchronously on a second stream.
#pragma once

#include <cuda_runtime.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "array.cuh"
#include "common.cuh"
#include "dtypes.cuh"
#include "strided.cuh"

namespace needle {
namespace cuda {

// ---- NumPy transfers --------------------------------------------------------------------------------------

// True when (shape, strides) is the row-major compact layout, so the view is one contiguous run of memory.
bool is_compact_layout(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
  int64_t expected = 1;
  for (size_t k = shape.size(); k-- > 0;) {
    if (shape[k] != 1 && strides[k] != expected) return false;  // a size-1 dimension's stride never matters
    expected *= shape[k];
  }
  return true;
}

// A C-contiguous numpy array of the storage type (bfloat16: its bit patterns as uint16).
py::array to_numpy(const CudaArray& a, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                   int64_t offset) {
  int64_t n = 0;
  const StridedView view = make_view("to_numpy", a.size, shape, strides, offset, &n);
  py::array result(py::dtype(dtype_info(a.dtype).numpy), std::vector<py::ssize_t>(shape.begin(), shape.end()));
  if (n == 0) return result;
  const size_t bytes = static_cast<size_t>(n) * a.itemsize;
  if (is_compact_layout(shape, strides)) {  // already contiguous: copy straight from the buffer
    const char* start = static_cast<const char*>(a.ptr) + static_cast<size_t>(offset) * a.itemsize;
    check_cuda(cudaMemcpy(result.mutable_data(), start, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy (to_numpy)");
  } else {  // compact on the device first, then one contiguous copy
    ScratchBuffer scratch(bytes);
    visit_dtype(a.dtype, [&](auto tag) {
      using T = TypeOf<decltype(tag)>;
      compact_kernel<<<grid_for(n), kBlockSize>>>(data<T>(a), static_cast<T*>(scratch.get()), n, view);
    });
    check_kernel("compact");
    check_cuda(cudaMemcpy(result.mutable_data(), scratch.get(), bytes, cudaMemcpyDeviceToHost),
               "cudaMemcpy (to_numpy)");
  }
  return result;
}

// Copies the bytes of a numpy array of out's storage type (bfloat16: its uint16 bit patterns, or an
// ml_dtypes.bfloat16 array) into out, as the reference does: the array, made C-contiguous when it is not, must
// have out's element count and itemsize.  The values are not converted: ndarray.py converts before it calls.
void from_numpy(const py::object& source, CudaArray& out) {
  const py::array array = py::array::ensure(source, py::array::c_style);
  if (!array) throw py::type_error("needle cuda: from_numpy: expects a numpy array");
  if (static_cast<size_t>(array.size()) != out.size || static_cast<size_t>(array.itemsize()) != out.itemsize) {
    throw py::value_error("needle cuda: from_numpy: got " + std::to_string(array.size()) + " elements of " +
                          std::to_string(array.itemsize()) + " bytes for an Array of " + std::to_string(out.size) +
                          " " + dtype_name(out.dtype) + " elements of " + std::to_string(out.itemsize) + " bytes");
  }
  if (out.size == 0) return;
  check_cuda(cudaMemcpy(out.ptr, array.data(), out.size * out.itemsize, cudaMemcpyHostToDevice),
             "cudaMemcpy (from_numpy)");
}

// ---- Offloaded optimizer state: page-locked host memory and copies on a second stream -------------------------
//
// Optimizer state offloaded to the host lives in page-locked ("pinned") numpy arrays, which the GPU copies to and
// from asynchronously.  The copies run on their own stream, so bringing the next parameter's state in overlaps
// the kernels that update the current one.  Every other kernel runs on the legacy default stream (the allocator
// relies on that order, see array.cuh), so each copy is tied to it by events:
//   - a copy waits for everything already queued on the default stream (the block it reads or writes may have
//     been handed out by the allocator after kernels that still use it);
//   - copy_to_host_async: the default stream then waits for the copy, so `a` may be freed (its block reused) at
//     once;
//   - copy_from_host_async returns the copy's event; the caller makes the default stream wait for it with
//     wait_copy right before the first kernel that reads `out`, so the kernels queued in between (the update of
//     the previous parameter) run while the copy does.
// The host must call synchronize_copies before it reads what copy_to_host_async wrote.

cudaStream_t copy_stream() {
  static cudaStream_t stream = [] {
    cudaStream_t s;
    check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return s;
  }();
  return stream;
}

// A recorded event, destroyed with its Python handle.
py::capsule record_event(cudaStream_t stream) {
  cudaEvent_t event;
  check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  check_cuda(cudaEventRecord(event, stream), "cudaEventRecord");
  return py::capsule(static_cast<void*>(event), [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); });
}

void wait_event(cudaStream_t stream, const py::capsule& event) {
  check_cuda(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(event.get_pointer()), 0), "cudaStreamWaitEvent");
}

// An uninitialized numpy array of `size` elements of `dtype` (its numpy storage type) in page-locked memory.
py::array pinned_empty(size_t size, const std::string& dtype) {
  const DTypeInfo& info = dtype_info(parse_dtype(dtype));
  void* ptr = nullptr;
  if (size > 0) check_cuda(cudaMallocHost(&ptr, size * info.itemsize), "cudaMallocHost (pinned_empty)");
  const py::capsule owner(ptr, [](void* p) {
    if (p) cudaFreeHost(p);
  });
  return py::array(py::dtype(info.numpy), {static_cast<py::ssize_t>(size)}, ptr, owner);
}

// `host` must be a C-contiguous numpy array of exactly `a`'s bytes (pinned, or the copy is not asynchronous).
void check_host_buffer(const char* fn, const py::array& host, const CudaArray& a) {
  if (!(host.flags() & py::array::c_style) || static_cast<size_t>(host.nbytes()) != a.size * a.itemsize) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": the host array must be C-contiguous with " +
                          std::to_string(a.size * a.itemsize) + " bytes (" + std::to_string(a.size) + " " +
                          dtype_name(a.dtype) + "), got " + std::to_string(host.nbytes()) + " bytes");
  }
}

void copy_to_host_async(const CudaArray& a, py::array out) {
  check_host_buffer("copy_to_host_async", out, a);
  if (!out.writeable()) throw py::value_error("needle cuda: copy_to_host_async: out is read-only");
  if (a.size == 0) return;
  wait_event(copy_stream(), record_event(cudaStreamLegacy));
  check_cuda(cudaMemcpyAsync(out.mutable_data(), a.ptr, a.size * a.itemsize, cudaMemcpyDeviceToHost, copy_stream()),
             "cudaMemcpyAsync (copy_to_host_async)");
  wait_event(cudaStreamLegacy, record_event(copy_stream()));
}

py::capsule copy_from_host_async(const py::array& host, CudaArray& out) {
  check_host_buffer("copy_from_host_async", host, out);
  wait_event(copy_stream(), record_event(cudaStreamLegacy));
  if (out.size > 0) {
    check_cuda(cudaMemcpyAsync(out.ptr, host.data(), out.size * out.itemsize, cudaMemcpyHostToDevice, copy_stream()),
               "cudaMemcpyAsync (copy_from_host_async)");
  }
  return record_event(copy_stream());
}

void wait_copy(const py::capsule& event) { wait_event(cudaStreamLegacy, event); }

void synchronize_copies() { check_cuda(cudaStreamSynchronize(copy_stream()), "cudaStreamSynchronize (copies)"); }

}  // namespace cuda
}  // namespace needle
