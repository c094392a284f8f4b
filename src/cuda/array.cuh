// array.cuh -- the `Array` Python sees (CudaArray: one block from the caching allocator, and its dtype), the
// allocator itself, and the dtype checks every host function makes on its arrays.
//
// cudaMalloc and cudaFree are slow (cudaFree also waits for the whole device), and a training step creates and
// drops hundreds of temporaries of the same few sizes.  So, like PyTorch and CuPy, we keep freed blocks in
// free lists keyed by a rounded "size class" and hand them out again; only a miss calls cudaMalloc.
//
// Rounding: requests up to 1 MiB are rounded up to a multiple of 512 bytes, larger ones to a multiple of 2 MiB.
// Rounding wastes at most 512 bytes on small blocks and under 2 MiB on large ones, while making it likely that
// the next request of a similar size finds a block of exactly its class.  A block is only reused for requests
// of exactly its class (no splitting): simple, and the cache is emptied and the malloc retried before giving up.
// Blocks are untyped bytes: an array of any dtype may reuse a block another dtype freed.
//
// Statistics are exact: current_bytes counts the bytes *requested* by live arrays (size * itemsize), not the
// rounded block sizes; reserved_bytes counts everything held from the driver (live blocks plus cached free
// blocks).
//
// No locking: every call into this module comes from Python holding the GIL, which serializes them.
//
// Everything runs on the legacy default stream, so kernels execute in the order they were issued.  That is
// what makes the caching allocator safe without any events: a block freed by one array and handed to the next
// is only touched by kernels queued after every kernel that used it before.  (The copies of host_copy.cuh run
// on a second stream and are tied to the default stream by events.)
#pragma once

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "common.cuh"
#include "dtypes.cuh"

namespace needle {
namespace cuda {

// ---- Caching allocator ------------------------------------------------------------------------------------

constexpr size_t kSmallRound = 512;                   // small blocks: 512-byte multiples
constexpr size_t kLargeThreshold = size_t(1) << 20;  // requests above 1 MiB are "large"
constexpr size_t kLargeRound = size_t(2) << 20;       // large blocks: 2 MiB multiples
// Larger requests are refused before any arithmetic on them could overflow (no GPU has 2^56 bytes).
constexpr size_t kMaxBytes = size_t(1) << 56;

constexpr size_t round_up(size_t x, size_t multiple) { return (x + multiple - 1) / multiple * multiple; }

constexpr size_t block_size_for(size_t bytes) {
  return bytes <= kLargeThreshold ? round_up(bytes, kSmallRound) : round_up(bytes, kLargeRound);
}

class CachingAllocator {
 public:
  // A block for a new Array of `bytes` bytes.  Applies the memory limit and updates the statistics.
  void* allocate_array(size_t bytes, size_t* block_bytes) {
    if (limit_bytes_ != 0 && bytes > 0 && current_bytes_ + bytes > limit_bytes_) {
      std::ostringstream msg;
      msg << "needle cuda: memory limit exceeded: asked " << bytes << " bytes, " << current_bytes_
          << " bytes held by live arrays, limit " << limit_bytes_ << " bytes";
      throw OutOfMemory(msg.str());
    }
    void* ptr = nullptr;
    *block_bytes = 0;
    if (bytes > 0) {  // an empty Array owns no device memory (and needs no GPU)
      *block_bytes = block_size_for(bytes);
      ptr = acquire_block(bytes, *block_bytes);
    }
    current_bytes_ += bytes;
    live_arrays_ += 1;
    peak_bytes_ = std::max(peak_bytes_, current_bytes_);
    return ptr;
  }

  // The Array died: its block goes back to the free list (never to the driver; see empty_cache).
  void free_array(void* ptr, size_t bytes, size_t block_bytes) noexcept {
    if (ptr != nullptr) release_block(ptr, block_bytes);
    current_bytes_ -= bytes;
    live_arrays_ -= 1;
  }

  // A block of size class `block_bytes`, from the cache or else from the driver.  It is not counted in the
  // array statistics here (allocate_array does that), so ScratchBuffer uses it directly.
  void* acquire_block(size_t requested_bytes, size_t block_bytes) {
    std::vector<void*>& free_list = free_blocks_[block_bytes];
    if (!free_list.empty()) {  // cache hit: no driver call at all
      void* ptr = free_list.back();  // most recently freed first: likely still in L2
      free_list.pop_back();
      return ptr;
    }
    void* ptr = nullptr;
    cudaError_t err = cudaMalloc(&ptr, block_bytes);
    if (err == cudaErrorMemoryAllocation) {
      // The driver is out of memory, but our cache may hold blocks of other size classes: give them back and
      // try once more.  cudaGetLastError clears the failure so the next check_kernel does not report it.
      cudaGetLastError();
      empty_cache();
      err = cudaMalloc(&ptr, block_bytes);
      if (err == cudaErrorMemoryAllocation) {
        cudaGetLastError();
        size_t free_on_device = 0;
        size_t total_on_device = 0;
        if (cudaMemGetInfo(&free_on_device, &total_on_device) != cudaSuccess) cudaGetLastError();
        std::ostringstream msg;
        msg << "needle cuda: out of memory: asked " << requested_bytes << " bytes, " << current_bytes_
            << " bytes held by live arrays, " << reserved_bytes_ << " reserved, " << free_on_device
            << " free on device (cudaMemGetInfo)";
        throw OutOfMemory(msg.str());
      }
    }
    check_cuda(err, "cudaMalloc");  // anything else (no device, driver too old, ...) is a RuntimeError
    reserved_bytes_ += block_bytes;
    return ptr;
  }

  void release_block(void* ptr, size_t block_bytes) noexcept {
    // push_back can only fail by running out of host memory; the block is then leaked, never crashed on.
    try {
      free_blocks_[block_bytes].push_back(ptr);
    } catch (...) {
    }
  }

  // Return every cached free block to the driver.  cudaFree waits for the device to finish queued work, so no
  // kernel can still be using a block we free here.
  void empty_cache() {
    cudaError_t first_error = cudaSuccess;
    for (auto& size_and_list : free_blocks_) {
      for (void* ptr : size_and_list.second) {
        const cudaError_t err = cudaFree(ptr);
        if (err != cudaSuccess && first_error == cudaSuccess) first_error = err;
        reserved_bytes_ -= size_and_list.first;
      }
    }
    free_blocks_.clear();
    check_cuda(first_error, "cudaFree (empty_cache)");
  }

  void reset_peak() { peak_bytes_ = current_bytes_; }
  void set_limit(size_t nbytes) { limit_bytes_ = nbytes; }

  size_t current_bytes() const { return current_bytes_; }
  size_t peak_bytes() const { return peak_bytes_; }
  size_t live_arrays() const { return live_arrays_; }
  size_t reserved_bytes() const { return reserved_bytes_; }

 private:
  std::unordered_map<size_t, std::vector<void*>> free_blocks_;  // size class -> free blocks of that class
  size_t current_bytes_ = 0;   // bytes requested by live arrays
  size_t peak_bytes_ = 0;      // max of current_bytes_ since the last reset
  size_t live_arrays_ = 0;     // number of live arrays
  size_t reserved_bytes_ = 0;  // bytes held from the driver: live blocks + cached free blocks
  size_t limit_bytes_ = 0;     // cap on current_bytes_; 0 = none
};

// Created on first use and deliberately never destroyed: Python may drop the last Arrays during interpreter
// shutdown, after C++ static destructors would already have run.  The driver reclaims device memory at exit.
CachingAllocator& allocator() {
  static CachingAllocator* const instance = new CachingAllocator();
  return *instance;
}

// Scratch device memory for the duration of one host function, from the cache, returned even on exceptions.
// It is not an Array, so it does not count in current_bytes.
class ScratchBuffer {
 public:
  explicit ScratchBuffer(size_t bytes) : block_bytes_(block_size_for(bytes)) {
    ptr_ = allocator().acquire_block(bytes, block_bytes_);
  }
  ~ScratchBuffer() { allocator().release_block(ptr_, block_bytes_); }
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  void* get() const { return ptr_; }

 private:
  size_t block_bytes_;
  void* ptr_ = nullptr;
};

// ---- CudaArray --------------------------------------------------------------------------------------------

// A flat buffer of `size` elements of `dtype` in device memory.  Python's NDArray keeps one as its `_handle`.
struct CudaArray {
  CudaArray(size_t num_elements, const std::string& requested_dtype)
      : size(num_elements), dtype(parse_dtype(requested_dtype)), itemsize(dtype_info(dtype).itemsize) {
    if (size > kMaxBytes / itemsize) {
      throw OutOfMemory("needle cuda: out of memory: asked for " + std::to_string(size) + " " + requested_dtype +
                        " elements");
    }
    ptr = allocator().allocate_array(size * itemsize, &block_bytes);
  }
  ~CudaArray() { allocator().free_array(ptr, size * itemsize, block_bytes); }
  CudaArray(const CudaArray&) = delete;  // one owner per block
  CudaArray& operator=(const CudaArray&) = delete;

  size_t ptr_as_int() const { return reinterpret_cast<size_t>(ptr); }

  size_t size;              // in elements
  DType dtype;              // what the elements are
  size_t itemsize;          // bytes per element
  size_t block_bytes = 0;   // size class of the block (>= size * itemsize); 0 when size == 0
  void* ptr = nullptr;      // nullptr when size == 0
};

// The buffer of `array` as T*.  The caller has checked (or dispatched on) array.dtype, so T is its storage type.
template <typename T>
T* data(const CudaArray& array) {
  return static_cast<T*>(array.ptr);
}

// ---- Dtype checks -----------------------------------------------------------------------------------------

// An argument as the error messages name it.
struct Arg {
  const char* name;
  const CudaArray& array;
};

// "a float16, b float32, out float32"
std::string describe_dtypes(std::initializer_list<Arg> args) {
  std::string text;
  for (const Arg& arg : args) {
    if (!text.empty()) text += ", ";
    text += std::string(arg.name) + " " + dtype_name(arg.array.dtype);
  }
  return text;
}

// The arithmetic functions: every array of one floating dtype.
void check_floating(const char* fn, std::initializer_list<Arg> args) {
  const DType first = args.begin()->array.dtype;
  bool ok = dtype_info(first).floating;
  for (const Arg& arg : args) ok = ok && arg.array.dtype == first;
  if (!ok) {
    throw py::type_error(std::string("needle cuda: ") + fn +
                         ": expects floating arrays (float32, float16 or bfloat16) all of one dtype, got " +
                         describe_dtypes(args));
  }
}

// The strided functions and matmul_tiled: float32 only.
void check_float32(const char* fn, std::initializer_list<Arg> args) {
  for (const Arg& arg : args) {
    if (arg.array.dtype != DType::kFloat32) {
      throw py::type_error(std::string("needle cuda: ") + fn + ": expects float32 arrays only, got " +
                           describe_dtypes(args));
    }
  }
}

// quantize_blockwise, dequantize_blockwise and the Adam steps take exactly one dtype per argument.
struct TypedArg {
  const char* name;
  const CudaArray& array;
  DType dtype;
};

void check_exact_dtypes(const char* fn, std::initializer_list<TypedArg> args) {
  bool ok = true;
  std::string expected, got;
  for (const TypedArg& arg : args) {
    ok = ok && arg.array.dtype == arg.dtype;
    expected += std::string(expected.empty() ? "" : ", ") + dtype_name(arg.dtype) + " " + arg.name;
    got += std::string(got.empty() ? "" : ", ") + arg.name + " " + dtype_name(arg.array.dtype);
  }
  if (!ok) throw py::type_error(std::string("needle cuda: ") + fn + ": expects " + expected + ", got " + got);
}

}  // namespace cuda
}  // namespace needle
