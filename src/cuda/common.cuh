// common.cuh -- what every part of the CUDA backend uses: errors, kernel launches, the device.
//
//   Errors          how CUDA failures become Python exceptions.  check_cuda follows every runtime API call and
//                   check_kernel every kernel launch: a failure raises RuntimeError naming the call or the
//                   kernel; OutOfMemory becomes MemoryError.  Nothing in the backend aborts the process.
//   Launch helpers  grid sizes for grid-stride loops, and the loop bounds the kernels use.
//   Host checks     the first of the cheap argument checks every host function makes (as_int64, check_size,
//                   checked_product, check_extents).
//   The device      device_count, which Python calls to decide whether the cuda device is enabled at all.
#pragma once

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace needle {
namespace cuda {

// ---- Errors -----------------------------------------------------------------------------------------------

// Thrown when memory runs out (driver or set_memory_limit); the module translates it to Python MemoryError.
// Every other failure is a std::runtime_error (-> RuntimeError) or a pybind11 error type.
struct OutOfMemory : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// For CUDA runtime API calls (cudaMalloc, cudaMemcpy, ...).
void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // the runtime also records the error; clear it so check_kernel does not report it later
    throw std::runtime_error(std::string("needle cuda: ") + what + " failed: " + cudaGetErrorString(err));
  }
}

// Called right after every kernel launch.  A bad launch (e.g. an invalid configuration) is reported here at
// once; a fault *inside* a kernel (e.g. an illegal address) is asynchronous and surfaces at the next
// synchronizing call instead, such as the cudaMemcpy of to_numpy.
void check_kernel(const char* kernel_name) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("needle cuda: kernel '") + kernel_name +
                             "' failed: " + cudaGetErrorString(err));
  }
}

// ---- Launch helpers ---------------------------------------------------------------------------------------
//
// Element-wise kernels use grid-stride loops: thread t handles elements t, t + T, t + 2T, ... where T is the
// number of threads in the grid.  Any n then works with a bounded grid, and each warp still touches 32
// consecutive elements at a time (coalesced).

constexpr int kBlockSize = 256;       // threads per block for the element-wise kernels
constexpr int64_t kMaxBlocks = 4096;  // 4096 * 256 = 1M threads: more than any current GPU runs at once
constexpr int kWarpSize = 32;
constexpr unsigned kFullWarpMask = 0xffffffffu;

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks for a grid-stride loop over n > 0 elements.
dim3 grid_for(int64_t n) { return dim3(static_cast<unsigned>(std::min(ceil_div(n, kBlockSize), kMaxBlocks))); }

// Loop bounds for grid-stride loops, in 64 bits so arrays past 2^31 elements work.
__device__ int64_t first_index() { return int64_t(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ int64_t grid_stride() { return int64_t(gridDim.x) * blockDim.x; }

// ---- Host checks ------------------------------------------------------------------------------------------
//
// Python validates views before they get here; these checks are the cheap second line that keeps a bug on the
// Python side from becoming a device fault.  py::value_error becomes ValueError, py::index_error IndexError,
// py::type_error TypeError (a dtype a function does not take).

int64_t as_int64(size_t n) { return static_cast<int64_t>(n); }

void check_size(const char* fn, const char* what, size_t actual, size_t expected) {
  if (actual != expected) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": " + what + " has " + std::to_string(actual) +
                          " elements, expected " + std::to_string(expected));
  }
}

// The element count of an array of these extents (each >= 0), or ValueError when it overflows 64 bits: a product
// that wrapped around could equal a small buffer's size, and a kernel would then read far past it.  As the CPU
// backend's (src/cpu/common.h).
template <class... Extents>
size_t checked_product(const char* fn, const char* what, Extents... extents) {
  size_t product = 1;
  bool overflow = false, zero = false;
  for (size_t extent : {static_cast<size_t>(extents)...}) {
    zero |= extent == 0;
    overflow |= __builtin_mul_overflow(product, extent, &product);
  }
  if (zero) return 0;  // exactly, even when the extents before the zero overflowed
  if (overflow) {
    std::ostringstream msg;
    msg << "needle cuda: " << fn << ": " << what << " would have ";
    const char* sep = "";
    ((msg << sep << extents, sep = " * "), ...);
    msg << " elements, more than a 64-bit size can count";
    throw py::value_error(msg.str());
  }
  return product;
}

// check_size against the product of the extents, overflow-checked.
template <class... Extents>
void check_extents(const char* fn, const char* what, size_t actual, Extents... extents) {
  check_size(fn, what, actual, checked_product(fn, what, extents...));
}

// ---- The device -------------------------------------------------------------------------------------------

// Number of usable GPUs; 0 (never an exception) when there is no GPU, no driver or a driver too old for this
// build: Python calls it to decide whether the cuda device is enabled at all.
int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // do not leave the failure for a later check to report
    return 0;
  }
  return count;
}

}  // namespace cuda
}  // namespace needle
