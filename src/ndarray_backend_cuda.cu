// ndarray_backend_cuda.cu -- the CUDA backend of needle.
//
// Python (python/needle/backend_ndarray/ndarray.py) owns shapes, strides and offsets; this module only ever
// sees flat device buffers of one dtype each plus the (shape, strides, offset) of a view.  src/README.md is the
// contract: every function here has the same name and arguments as in ndarray_backend_cpu.cc, so Python never
// branches on the device.  All strides and offsets are counted in elements, not bytes.
//
// The file reads top to bottom:
//   1. Errors         how CUDA failures become Python exceptions (RuntimeError, MemoryError, IndexError,
//                     ValueError, TypeError).  Nothing in this file aborts the process.
//   2. Dtypes         the six storage types, the conversions between them and float32, and the one switch
//                     that turns a run-time dtype into a compile-time type.
//   3. Allocator      a caching allocator: memory is taken from the driver (cudaMalloc) once, then recycled
//                     through size-class free lists, with exact statistics of what live arrays hold.
//   4. CudaArray      the `Array` Python sees: one block from the allocator, and its dtype.
//   5. Launch helpers grid sizes for grid-stride loops, and the error check that follows every launch.
//   6. Kernels        strided copies, element-wise ops, reductions, block-wise 8-bit quantization, two matmuls,
//                     row gather / scatter.
//   7. Host wrappers  cheap argument checks on the host, then one kernel launch each.
//   8. Bindings       the pybind11 module `ndarray_backend_cuda`.
//
// Everything runs on the legacy default stream, so kernels execute in the order they were issued.  That is
// what makes the caching allocator safe without any events: a block freed by one array and handed to the next
// is only touched by kernels queued after every kernel that used it before.
//
// Nothing runs on the GPU at import time.  The first CUDA call happens when device_count() is called or an
// Array of non-zero size is created, so `import ndarray_backend_cuda` works on machines without a GPU.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace needle {
namespace cuda {

// ------------------------------------------------------------------------------------------------------------
// 1. Errors
// ------------------------------------------------------------------------------------------------------------

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

// ------------------------------------------------------------------------------------------------------------
// 2. Dtypes
// ------------------------------------------------------------------------------------------------------------
//
// An Array stores float32, float16 (__half), bfloat16 (__nv_bfloat16), int8, uint8 or int32 (src/README.md,
// "Dtypes").  Whatever the storage, arithmetic is float32: a kernel loads each operand with to_float, computes
// in float and rounds the result once, with from_float<T>, when it stores it; reductions and matmul accumulate
// in float.  So each kernel is written once, over its storage type T, and its float32 instantiation is exactly
// the float32-only kernel this file had before dtypes (to_float(float) and from_float<float> do nothing).
//
// Integers are storage (labels, indices, quantized optimizer state): they are copied and converted (compact,
// ewise_setitem, fill, scalar_setitem, take_rows) and read as indices, never computed with.

enum class DType { kFloat32, kFloat16, kBFloat16, kInt8, kUInt8, kInt32 };

struct DTypeInfo {
  const char* name;   // as Python spells it
  size_t itemsize;    // bytes per element
  bool floating;      // float32, float16, bfloat16: the dtypes the arithmetic functions take
  const char* numpy;  // the numpy dtype of to_numpy / from_numpy (bfloat16: its bit patterns, as uint16)
};

// Indexed by DType.
constexpr DTypeInfo kDTypes[] = {
    {"float32", 4, true, "float32"}, {"float16", 2, true, "float16"}, {"bfloat16", 2, true, "uint16"},
    {"int8", 1, false, "int8"},      {"uint8", 1, false, "uint8"},    {"int32", 4, false, "int32"},
};

const DTypeInfo& dtype_info(DType dtype) { return kDTypes[static_cast<int>(dtype)]; }
const char* dtype_name(DType dtype) { return dtype_info(dtype).name; }

DType parse_dtype(const std::string& name) {
  for (size_t k = 0; k < std::size(kDTypes); ++k) {
    if (name == kDTypes[k].name) return static_cast<DType>(k);
  }
  throw py::value_error("needle cuda: unknown dtype '" + name +
                        "' (expected float32, float16, bfloat16, int8, uint8 or int32)");
}

// ---- Conversions --------------------------------------------------------------------------------------------
//
// __host__ __device__: the kernels convert every element, and the host converts a fill value or reads indices
// with the very same functions.

// The bits of a float32, and back.
__host__ __device__ inline uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
#endif
}

__host__ __device__ inline float float_from_bits(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
#endif
}

// The value as float32.  Exact for every storage type except int32 beyond 2^24, which rounds to nearest (as
// NumPy's int32 -> float32 does).  A float16 NaN keeps its sign and payload, as in NumPy (__half2float returns
// one canonical NaN), so that a NaN converted between dtypes has the same bits on every backend.
__host__ __device__ inline float to_float(float x) { return x; }
__host__ __device__ inline float to_float(__half x) {
  const uint32_t h = __half_as_ushort(x);
  if ((h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0) {  // NaN: all-ones exponent, non-zero payload
    return float_from_bits(((h & 0x8000u) << 16) | 0x7F800000u | ((h & 0x3FFu) << 13));
  }
  return __half2float(x);
}
__host__ __device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__host__ __device__ inline float to_float(int8_t x) { return static_cast<float>(x); }
__host__ __device__ inline float to_float(uint8_t x) { return static_cast<float>(x); }
__host__ __device__ inline float to_float(int32_t x) { return static_cast<float>(x); }

// The range of each integer storage type (std::numeric_limits is host code to nvcc).
template <typename T>
struct IntRange;
template <>
struct IntRange<int8_t> {
  static constexpr int64_t lo = -128, hi = 127;
};
template <>
struct IntRange<uint8_t> {
  static constexpr int64_t lo = 0, hi = 255;
};
template <>
struct IntRange<int32_t> {
  static constexpr int64_t lo = -2147483648LL, hi = 2147483647LL;
};

// float -> integer as the contract says: NaN -> 0, the fraction dropped (toward zero), saturated at the type's
// range.  The range ends are compared as floats: lo (0 or -2^k) is exact; hi (2^k - 1) may round up to 2^k
// (int32), but then x >= 2^k saturates and anything below it truncates to a value that fits.
template <typename T>
__host__ __device__ T float_to_int(float x) {
  if (x != x) return 0;  // NaN
  if (x <= static_cast<float>(IntRange<T>::lo)) return static_cast<T>(IntRange<T>::lo);
  if (x >= static_cast<float>(IntRange<T>::hi)) return static_cast<T>(IntRange<T>::hi);
  return static_cast<T>(x);  // C++'s float -> int conversion truncates toward zero
}

// float32 -> float16 / bfloat16: to nearest, ties to even, overflow to ±inf (__float2half_rn,
// __float2bfloat16_rn).  Only NaN is handled by hand: CUDA returns one canonical NaN (0x7FFF), while NumPy
// keeps the sign and the payload's top bits (float16) or gives the quiet NaN of the same sign (ml_dtypes'
// bfloat16).  Doing as NumPy does gives a converted NaN the same bits on every backend.
__host__ __device__ inline __half float_to_half(float x) {
  if (x != x) {
    const uint32_t bits = float_bits(x);
    const uint32_t sign = (bits >> 16) & 0x8000u;
    unsigned short h = static_cast<unsigned short>(sign | 0x7C00u | ((bits & 0x7FFFFFu) >> 13));
    if ((h & 0x3FFu) == 0) h |= 1u;  // the payload's top 10 bits were all zero: keep it a NaN, not inf
    return __ushort_as_half(h);
  }
  return __float2half_rn(x);
}

__host__ __device__ inline __nv_bfloat16 float_to_bfloat16(float x) {
  if (x != x) return __ushort_as_bfloat16(static_cast<unsigned short>((float_bits(x) >> 31) ? 0xFFC0u : 0x7FC0u));
  return __float2bfloat16_rn(x);
}

// A float32 result stored as T: the one rounding of every computation.
template <typename T>
__host__ __device__ T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, __half>) {
    return float_to_half(x);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return float_to_bfloat16(x);
  } else {
    return float_to_int<T>(x);
  }
}

// One element of storage type In as storage type Out (compact / ewise_setitem across dtypes: astype).
// The same type is copied bit for bit; integer -> integer saturates (through int64, which holds every value of
// both); everything else goes through float32 (exact except int32 past 2^24) and from_float, which rounds once.
template <typename Out, typename In>
__host__ __device__ Out convert(In x) {
  if constexpr (std::is_same_v<Out, In>) {
    return x;
  } else if constexpr (std::is_integral_v<Out> && std::is_integral_v<In>) {
    const int64_t v = x;
    const int64_t clamped = v < IntRange<Out>::lo ? IntRange<Out>::lo : (v > IntRange<Out>::hi ? IntRange<Out>::hi : v);
    return static_cast<Out>(clamped);
  } else {
    return from_float<Out>(to_float(x));
  }
}

// A row or column index stored in any dtype; the host has checked it is an integer in range before any kernel
// reads it.  Integers are used as they are: an int32 index past 2^24 would not survive a trip through float.
template <typename T>
__device__ int64_t to_index(T v) {
  if constexpr (std::is_integral_v<T>) {
    return v;
  } else {
    return static_cast<int64_t>(to_float(v));
  }
}

// ---- From a run-time dtype to a compile-time type -----------------------------------------------------------
//
// visit_dtype(dtype, f) calls f(TypeTag<T>()) with the storage type T of `dtype`.  f is a generic lambda that
// reads T back as `TypeOf<decltype(tag)>` and launches its kernel for T.  These switches are the only places
// where a dtype becomes a type, so each operation's launch is written once.

template <typename T>
struct TypeTag {
  using type = T;
};
template <typename Tag>
using TypeOf = typename Tag::type;

template <typename Visit>
void visit_dtype(DType dtype, Visit&& visit) {
  switch (dtype) {
    case DType::kFloat32: return visit(TypeTag<float>());
    case DType::kFloat16: return visit(TypeTag<__half>());
    case DType::kBFloat16: return visit(TypeTag<__nv_bfloat16>());
    case DType::kInt8: return visit(TypeTag<int8_t>());
    case DType::kUInt8: return visit(TypeTag<uint8_t>());
    case DType::kInt32: return visit(TypeTag<int32_t>());
  }
}

// The floating dtypes only.  The arithmetic functions check their dtypes before they get here, so their kernels
// are never instantiated for an integer type.
template <typename Visit>
void visit_floating(DType dtype, Visit&& visit) {
  switch (dtype) {
    case DType::kFloat32: return visit(TypeTag<float>());
    case DType::kFloat16: return visit(TypeTag<__half>());
    case DType::kBFloat16: return visit(TypeTag<__nv_bfloat16>());
    default: throw std::logic_error("needle cuda: visit_floating: an integer dtype got past the dtype checks");
  }
}

// ------------------------------------------------------------------------------------------------------------
// 3. Allocator
// ------------------------------------------------------------------------------------------------------------
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

// ------------------------------------------------------------------------------------------------------------
// 4. CudaArray
// ------------------------------------------------------------------------------------------------------------

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

// ------------------------------------------------------------------------------------------------------------
// 5. Launch helpers
// ------------------------------------------------------------------------------------------------------------
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

// ------------------------------------------------------------------------------------------------------------
// 6. Kernels
// ------------------------------------------------------------------------------------------------------------

// ---- Strided views ----------------------------------------------------------------------------------------
//
// A view (shape, strides, offset) travels to the kernel by value in this fixed-size struct: kernel arguments
// live in a constant bank every thread can read, so no device allocation or copy is needed for it.

constexpr int kMaxDims = 8;

struct StridedView {
  int ndim;
  int64_t shape[kMaxDims];
  int64_t strides[kMaxDims];
  int64_t offset;
};

// Where element i of the compact (row-major) enumeration of a view lives in the underlying buffer.
// The multi-index (idx_0, ..., idx_{d-1}) of i is read off like the digits of a number, last dimension first
// (it varies fastest): idx_{d-1} = i % shape_{d-1}, then i /= shape_{d-1}, then idx_{d-2} = i % shape_{d-2}, ...
// and the element lives at offset + sum_k idx_k * strides_k.
__device__ int64_t strided_index(const StridedView& view, int64_t i) {
  int64_t pos = view.offset;
#pragma unroll
  for (int k = kMaxDims - 1; k >= 0; --k) {
    // Unrolled, so k is a compile-time constant and view.shape[k] is read straight from the kernel
    // arguments; a run-time index would make every thread copy the struct to (slow) local memory.
    if (k < view.ndim) {
      pos += (i % view.shape[k]) * view.strides[k];
      i /= view.shape[k];
    }
  }
  return pos;
}

// out[i] = a[view(i)]: gather a strided view into a compact buffer, converted to out's type (astype).
template <typename In, typename Out>
__global__ void compact_kernel(const In* a, Out* out, int64_t n, StridedView view) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = convert<Out>(a[strided_index(view, i)]);
}

// out[view(i)] = a[i]: the inverse scatter.
template <typename In, typename Out>
__global__ void ewise_setitem_kernel(const In* a, Out* out, int64_t n, StridedView view) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[strided_index(view, i)] = convert<Out>(a[i]);
}

// out[view(i)] = val (already converted to T on the host).
template <typename T>
__global__ void scalar_setitem_kernel(T val, T* out, int64_t n, StridedView view) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[strided_index(view, i)] = val;
}

template <typename T>
__global__ void fill_kernel(T* out, int64_t n, T val) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = val;
}

// ---- Stochastic rounding to bfloat16 ----------------------------------------------------------------------
//
// bfloat16 keeps the upper 16 bits of a float32.  Adding a uniform 16-bit random number to the lower 16 bits
// before truncating rounds up with probability (lower bits) / 2^16: the expected result is the exact value, so
// tiny updates to bfloat16 weights are not all lost to round-to-nearest.  The random number is a hash of the
// element's index and the seed (no state): the same bits on every backend and every launch shape.

// Chris Wellons' "lowbias32" integer hash (src/README.md spells it out for all backends).
__host__ __device__ inline uint32_t lowbias32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7feb352du;
  h ^= h >> 15;
  h *= 0x846ca68bu;
  h ^= h >> 16;
  return h;
}

// Element i of float32 x rounded stochastically to bfloat16; seed_hash = uint32(seed * 0x9E3779B9).
__host__ __device__ inline __nv_bfloat16 round_stochastic_element(float x, int64_t i, uint32_t seed_hash) {
  const uint32_t bits = float_bits(x);
  if ((bits & 0x7F800000u) == 0x7F800000u) return from_float<__nv_bfloat16>(x);  // NaN and ±inf as compact does
  // A finite float's bits are at most 0xFF7FFFFF, so adding 0xFFFF cannot wrap; the largest values may carry
  // into the exponent and give ±inf, exactly as the contract's formula says.
  const uint32_t noise = lowbias32(static_cast<uint32_t>(i) ^ seed_hash) & 0xFFFFu;
  return __ushort_as_bfloat16(static_cast<unsigned short>((bits + noise) >> 16));
}

__global__ void round_stochastic_kernel(const float* a, __nv_bfloat16* out, int64_t n, uint32_t seed_hash) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = round_stochastic_element(a[i], i, seed_hash);
}

// dropout (src/README.md): out[i] = a[i] * m / keep, m from the hash of (seed, i) as attention's mask has it.
template <typename T>
__global__ void dropout_kernel(const T* a, T* out, int64_t n, uint32_t seed_key, uint32_t threshold, float keep) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const uint64_t idx = static_cast<uint64_t>(i);
    const uint32_t key = lowbias32(static_cast<uint32_t>(idx >> 32) ^ seed_key);
    const float m = lowbias32(static_cast<uint32_t>(idx) ^ key) >= threshold ? 1.0f : 0.0f;
    out[i] = from_float<T>(__fdiv_rn(__fmul_rn(to_float(a[i]), m), keep));
  }
}

// ---- Element-wise operations ------------------------------------------------------------------------------
//
// One small functor per operation and three generic kernels (array-array, array-scalar, unary).  The functor
// is a template argument, so the compiler inlines it: each instantiation is as fast as a hand-written kernel.
// The functors work on float; the kernels load each element with to_float and store with from_float<T>.

struct AddOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct SubOp {
  __device__ float operator()(float a, float b) const { return a - b; }
};
struct MulOp {
  __device__ float operator()(float a, float b) const { return a * b; }
};
struct DivOp {
  __device__ float operator()(float a, float b) const { return a / b; }
};
// a^0.5 is a correctly rounded square root (CUDA's powf may be 2 ulp off), as NumPy and the C++ backend compute it.
struct PowerOp {
  __device__ float operator()(float a, float b) const { return b == 0.5f ? __fsqrt_rn(a) : powf(a, b); }
};
// NaN wins, as in numpy.maximum (fmaxf would drop it): the NumPy backend is the specification.
struct MaximumOp {
  __device__ float operator()(float a, float b) const { return (a > b || isnan(a)) ? a : b; }
};
struct EqOp {
  __device__ float operator()(float a, float b) const { return a == b ? 1.0f : 0.0f; }
};
struct GeOp {
  __device__ float operator()(float a, float b) const { return a >= b ? 1.0f : 0.0f; }
};
struct GtOp {
  __device__ float operator()(float a, float b) const { return a > b ? 1.0f : 0.0f; }
};
struct LogOp {
  __device__ float operator()(float a) const { return logf(a); }
};
struct ExpOp {
  __device__ float operator()(float a) const { return expf(a); }
};
struct TanhOp {
  __device__ float operator()(float a) const { return tanhf(a); }
};

template <typename T, typename Op>
__global__ void ewise_kernel(const T* a, const T* b, T* out, int64_t n, Op op) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = from_float<T>(op(to_float(a[i]), to_float(b[i])));
}

template <typename T, typename Op>
__global__ void scalar_kernel(const T* a, float val, T* out, int64_t n, Op op) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = from_float<T>(op(to_float(a[i]), val));
}

template <typename T, typename Op>
__global__ void unary_kernel(const T* a, T* out, int64_t n, Op op) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = from_float<T>(op(to_float(a[i])));
}

// The same three on strided views (ewise_strided, scalar_strided, unary_strided): every operand is a view of
// the output's shape, read at strided_index(view, i), so a broadcast operand (stride 0) or a transposed one is
// never copied first.  out is compact: consecutive threads still write consecutive floats.  float32 only
// (ndarray.py hands non-compact 16-bit operands to the compact kernels above as compact copies).
template <typename Op>
__global__ void ewise_strided_kernel(const float* a, StridedView va, const float* b, StridedView vb, float* out,
                                     int64_t n, Op op) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    out[i] = op(a[strided_index(va, i)], b[strided_index(vb, i)]);
  }
}

template <typename Op>
__global__ void scalar_strided_kernel(const float* a, StridedView va, float val, float* out, int64_t n, Op op) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = op(a[strided_index(va, i)], val);
}

template <typename Op>
__global__ void unary_strided_kernel(const float* a, StridedView va, float* out, int64_t n, Op op) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = op(a[strided_index(va, i)]);
}

// ---- Reductions -------------------------------------------------------------------------------------------
//
// `a` is viewed as (rows, reduce_size); out[row] = reduction of that row.  One block per row (grid-stride over
// rows when there are more rows than blocks).  Three stages, all in registers or shared memory:
//   1. each thread folds the elements j = threadIdx.x, threadIdx.x + blockDim.x, ... of the row (coalesced);
//   2. each warp combines its 32 partial results with shuffles (no shared memory, no __syncthreads);
//   3. warp 0 combines the per-warp results staged in shared memory.
// The combination order is fixed for a given launch shape, so results are deterministic run to run.
// Partial results are floats whatever the storage type: only the row's result is rounded to T.

constexpr int kReduceMaxThreads = 256;
constexpr int64_t kReduceMaxBlocks = 65536;

struct SumReduce {
  __device__ static float identity() { return 0.0f; }
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct MaxReduce {
  __device__ static float identity() { return -INFINITY; }
  __device__ float operator()(float a, float b) const { return MaximumOp()(a, b); }
};

// After this, lane 0 holds the reduction of the 32 lanes' values.
template <typename Op>
__device__ float warp_reduce(float value, Op op) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = op(value, __shfl_down_sync(kFullWarpMask, value, offset));
  }
  return value;
}

// blockDim.x must be a multiple of 32 and at most kReduceMaxThreads (the host wrapper guarantees both).
template <typename T, typename Op>
__global__ void reduce_kernel(const T* a, T* out, int64_t rows, int64_t reduce_size, Op op) {
  __shared__ float warp_results[kReduceMaxThreads / kWarpSize];
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int num_warps = static_cast<int>(blockDim.x) / kWarpSize;

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* in = a + row * reduce_size;
    float acc = Op::identity();
    for (int64_t j = threadIdx.x; j < reduce_size; j += blockDim.x) acc = op(acc, to_float(in[j]));  // stage 1
    acc = warp_reduce(acc, op);                                                                       // stage 2
    if (lane == 0) warp_results[warp] = acc;
    __syncthreads();
    if (warp == 0) {                                                                                  // stage 3
      acc = lane < num_warps ? warp_results[lane] : Op::identity();
      acc = warp_reduce(acc, op);
      if (lane == 0) out[row] = from_float<T>(acc);
    }
    __syncthreads();  // warp_results is overwritten for the next row
  }
}

// The same three stages for a whole block, the result handed to every thread (through shared memory).
template <typename Op>
__device__ float block_reduce(float acc, Op op) {
  __shared__ float partial[kReduceMaxThreads / kWarpSize];
  __shared__ float result;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int num_warps = static_cast<int>(blockDim.x) / kWarpSize;
  acc = warp_reduce(acc, op);
  if (lane == 0) partial[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < num_warps ? partial[lane] : Op::identity();
    acc = warp_reduce(acc, op);
    if (lane == 0) result = acc;
  }
  __syncthreads();
  const float value = result;
  __syncthreads();  // partial and result are reused by the next call
  return value;
}

// One block per row of `a` (rows, reduce_size): lse = m + log Σ exp(x - m), m the row's maximum (a row whose
// maximum is not finite gives m).  Writes lse[row] if `lse` is given; if `grad` is given, also the softmax
// cross-entropy gradient grad[row, j] = g[row] * (exp(x_j - lse) - [j == idx[row]]), the row read again.
// lse stays a float inside the kernel: the gradient uses the unrounded value.
template <typename T, typename TIdx>
__global__ void logsumexp_rows_kernel(const T* a, T* lse, const TIdx* idx, const T* g, T* grad, int64_t rows,
                                      int64_t reduce_size) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* in = a + row * reduce_size;
    float m = MaxReduce::identity();
    for (int64_t j = threadIdx.x; j < reduce_size; j += blockDim.x) m = MaxReduce()(m, to_float(in[j]));
    m = block_reduce(m, MaxReduce());
    float total = 0.0f;
    if (isfinite(m)) {
      for (int64_t j = threadIdx.x; j < reduce_size; j += blockDim.x) total += expf(to_float(in[j]) - m);
    }
    total = block_reduce(total, SumReduce());
    const float row_lse = isfinite(m) ? m + logf(total) : m;
    if (lse != nullptr && threadIdx.x == 0) lse[row] = from_float<T>(row_lse);
    if (grad != nullptr) {
      const int64_t label = to_index(idx[row]);
      const float g_row = to_float(g[row]);
      for (int64_t j = threadIdx.x; j < reduce_size; j += blockDim.x) {
        grad[row * reduce_size + j] =
            from_float<T>(g_row * (expf(to_float(in[j]) - row_lse) - (j == label ? 1.0f : 0.0f)));
      }
    }
  }
}

// ---- Block-wise 8-bit quantization (Dettmers et al. 2021) -------------------------------------------------
//
// A flat array of n elements is cut into blocks [b * block_size, min(n, (b + 1) * block_size)).  Block b keeps
// one float, its largest magnitude absmax[b], and each element one byte: the index of the `code` value (256
// ascending floats) nearest to a[i] / absmax[b].  One thread block quantizes one block at a time (grid-stride
// over the blocks), in three steps:
//   1. each thread takes the largest |a[i]| of its elements i = begin + tid, begin + tid + blockDim.x, ...;
//   2. block_reduce combines them (NaN-propagating, as MaximumOp), and every thread gets absmax[b];
//   3. each thread maps the same elements again (a second read of the block, now from cache) through the code
//      table, which each thread block copies to shared memory once.

constexpr int kCodeSize = 256;  // one code value per byte value

// The index the contract gives x (src/README.md): lo = the largest j with code[j] <= x, 0 if there is none (so
// NaN gives 0).  code[j] <= x holds for a prefix of the ascending code, and the search sets one bit of lo per
// step (128, 64, ..., 1) while code[lo + step] is still inside that prefix.  Then the nearer of code[lo] and
// code[lo + 1] wins, a tie going to lo.
__device__ uint8_t nearest_code(const float* code, float x) {
  int lo = 0;
#pragma unroll
  for (int step = kCodeSize / 2; step > 0; step /= 2) {
    if (code[lo + step] <= x) lo += step;
  }
  const int hi = lo + 1 < kCodeSize ? lo + 1 : kCodeSize - 1;
  return static_cast<uint8_t>(code[hi] - x < x - code[lo] ? hi : lo);
}

// blockDim.x must be a multiple of 32 and at most kReduceMaxThreads (block_reduce's requirement).
__global__ void quantize_blockwise_kernel(const float* a, const float* code, uint8_t* out, float* absmax, int64_t n,
                                          int64_t block_size, int64_t num_blocks) {
  __shared__ float table[kCodeSize];
  for (int j = threadIdx.x; j < kCodeSize; j += blockDim.x) table[j] = code[j];
  __syncthreads();
  for (int64_t b = blockIdx.x; b < num_blocks; b += gridDim.x) {  // the same b for every thread of the block
    const int64_t begin = b * block_size;
    const int64_t end = n - begin < block_size ? n : begin + block_size;
    float m = 0.0f;  // every |a[i]| is >= 0 (or NaN, which MaximumOp keeps)
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) m = MaximumOp()(m, fabsf(a[i]));
    m = block_reduce(m, MaxReduce());
    if (threadIdx.x == 0) absmax[b] = m;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const float x = m == 0.0f ? 0.0f : __fdiv_rn(a[i], m);  // IEEE division whatever the compiler flags
      out[i] = nearest_code(table, x);
    }
  }
}

// out[i] = code[q[i]] * absmax[i / block_size], a grid-stride loop with the code table in shared memory.
__global__ void dequantize_blockwise_kernel(const uint8_t* q, const float* code, const float* absmax, float* out,
                                            int64_t n, int64_t block_size) {
  __shared__ float table[kCodeSize];
  for (int j = threadIdx.x; j < kCodeSize; j += blockDim.x) table[j] = code[j];
  __syncthreads();
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = table[q[i]] * absmax[i / block_size];
}

// ---- Adam, fused -----------------------------------------------------------------------------------------

// The hyper-parameters as the element-wise ops see Python floats: each rounded once to float32 (1 - beta in double
// first).
struct AdamHyper {
  float b1, a1, b2, a2, c1, c2, lr, eps;  // beta1, 1 - beta1, beta2, 1 - beta2, 1 - beta1^t, 1 - beta2^t, lr, eps
};

AdamHyper adam_hyper(double lr, double beta1, double beta2, double eps, double correction1, double correction2) {
  return {static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
          static_cast<float>(1.0 - beta2), static_cast<float>(correction1), static_cast<float>(correction2),
          static_cast<float>(lr), static_cast<float>(eps)};
}

// adam_step (src/README.md): Adam's update of one float32 parameter, one thread per element (grid-stride), every
// operation rounded as the element-wise kernels round it (no fused multiply-add).
__global__ void adam_step_kernel(const float* theta, const float* grad, const float* m, const float* v, float* out,
                                 float* out_m, float* out_v, int64_t n, bool first, AdamHyper h) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const float g = grad[i], gg = __fmul_rn(g, g);
    const float mk = first ? __fmul_rn(g, h.a1) : __fadd_rn(__fmul_rn(m[i], h.b1), __fmul_rn(g, h.a1));
    const float vk = first ? __fmul_rn(gg, h.a2) : __fadd_rn(__fmul_rn(v[i], h.b2), __fmul_rn(gg, h.a2));
    const float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(vk, h.c2)), h.eps);
    out[i] = __fsub_rn(theta[i], __fdiv_rn(__fmul_rn(__fdiv_rn(mk, h.c1), h.lr), denom));
    out_m[i] = mk;
    out_v[i] = vk;
  }
}

// ---- 8-bit Adam, fused (Dettmers et al. 2021) ----------------------------------------------------------------
//
// adam8bit_step (src/README.md): per element, m and v = r * r are dequantized (q_v stores r = sqrt(v)), updated as
// Adam does, theta updated, and the block's new m and r quantized.  One thread block per quantization block
// (grid-stride), each thread owning the same elements throughout, in two passes:
//   1. compute the new m, r and theta (written), and the block's new absmax of m and of r (block_reduce);
//   2. compute m and r again from the still unchanged bytes (cheaper than holding a block of any size in
//      shared memory) and write their new bytes.
// Every operation is an IEEE round-to-nearest intrinsic (no contraction into FMA), so the bytes are the NumPy
// reference's.
__device__ void adam8bit_moments(const AdamHyper& h, float m, float r, float g, float* m_out, float* v_out) {
  *m_out = __fadd_rn(__fmul_rn(m, h.b1), __fmul_rn(g, h.a1));
  *v_out = __fadd_rn(__fmul_rn(__fmul_rn(r, r), h.b2), __fmul_rn(__fmul_rn(g, g), h.a2));
}

__global__ void adam8bit_step_kernel(const float* theta, const float* grad, uint8_t* q_m, float* absmax_m,
                                     uint8_t* q_v, float* absmax_v, const float* code_m, const float* code_v,
                                     float* out, int64_t n, int64_t block_size, int64_t num_blocks, AdamHyper h) {
  __shared__ float table_m[kCodeSize], table_v[kCodeSize];
  for (int j = threadIdx.x; j < kCodeSize; j += blockDim.x) {
    table_m[j] = code_m[j];
    table_v[j] = code_v[j];
  }
  __syncthreads();
  for (int64_t b = blockIdx.x; b < num_blocks; b += gridDim.x) {
    const int64_t begin = b * block_size;
    const int64_t end = n - begin < block_size ? n : begin + block_size;
    const float old_m = absmax_m[b], old_r = absmax_v[b];
    float new_m = 0.0f, new_r = 0.0f;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {  // pass 1
      float m, v;
      adam8bit_moments(h, __fmul_rn(table_m[q_m[i]], old_m), __fmul_rn(table_v[q_v[i]], old_r), grad[i], &m, &v);
      const float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(v, h.c2)), h.eps);
      out[i] = __fsub_rn(theta[i], __fdiv_rn(__fmul_rn(__fdiv_rn(m, h.c1), h.lr), denom));
      new_m = MaximumOp()(new_m, fabsf(m));
      new_r = MaximumOp()(new_r, __fsqrt_rn(v));
    }
    new_m = block_reduce(new_m, MaxReduce());  // every thread has read old_m, old_r before thread 0 writes
    new_r = block_reduce(new_r, MaxReduce());
    if (threadIdx.x == 0) {
      absmax_m[b] = new_m;
      absmax_v[b] = new_r;
    }
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {  // pass 2
      float m, v;
      adam8bit_moments(h, __fmul_rn(table_m[q_m[i]], old_m), __fmul_rn(table_v[q_v[i]], old_r), grad[i], &m, &v);
      const float r = __fsqrt_rn(v);
      q_m[i] = nearest_code(table_m, new_m == 0.0f ? 0.0f : __fdiv_rn(m, new_m));
      q_v[i] = nearest_code(table_v, new_r == 0.0f ? 0.0f : __fdiv_rn(r, new_r));
    }
  }
}

// ---- Matrix multiplication --------------------------------------------------------------------------------
//
// out (m x p) = a (m x n) @ b (n x p), all compact row-major, for each of `batch` consecutive triples of matrices
// (matmul is the batch of one; matmul_batched uses blockIdx.z for the batch index, grid-stride past the
// 65535 limit of gridDim.z).  Each block computes a 64 x 64 tile of `out`.
// It walks along n in slices of 16: the block stages a 64 x 16 slice of `a` and a 16 x 64 slice of `b` in shared
// memory (every element read from global memory once per block instead of 64 times), then each of the
// 256 threads accumulates a 4 x 4 patch of `out` in registers (register tiling: every value loaded from shared
// memory is used 4 times).  Thread (tx, ty) owns rows ty + 16*i and columns tx + 16*j of the tile: consecutive
// threads own consecutive columns, so both the shared-memory reads and the final global stores are contiguous.
// Out-of-range elements are staged as zeros, so any m, n, p work.
// a and b are of storage type TIn and widened to float as they are staged, so the tiles and the accumulators
// are float32 for every dtype; out (TOut: TIn, or float32 for 16-bit inputs) is rounded once, at the end.

constexpr int kMmTileRows = 64;                                    // rows of `out` per block
constexpr int kMmTileCols = 64;                                    // columns of `out` per block
constexpr int kMmTileDepth = 16;                                   // slice of n staged per step
constexpr int kMmThreadRows = 4;                                   // each thread: 4 x 4 outputs
constexpr int kMmThreadCols = 4;
constexpr int kMmThreadsX = kMmTileCols / kMmThreadCols;           // 16
constexpr int kMmThreadsY = kMmTileRows / kMmThreadRows;           // 16
constexpr int kMmThreads = kMmThreadsX * kMmThreadsY;              // 256
constexpr int64_t kMaxGridY = 65535;                               // hardware limit of gridDim.y
constexpr int64_t kMaxGridZ = 65535;                               // and of gridDim.z
// a_tile is stored transposed (k-major) so the inner loop reads columns of the a slice contiguously.  Its
// loads write (16 k's x 2 rows) per warp; rows padded to 64 + 2 floats put those 32 stores in 32 distinct banks.
constexpr int kMmATilePitch = kMmTileRows + 2;

// Where element (r, c) of a and of b sits: a[r * a_rs + c * a_cs] (a_rs = n, a_cs = 1 for a compact a; 1 and m
// for a given transposed, as matmul's trans_a says), and likewise b.
struct MatmulStrides {
  int64_t a_rs, a_cs, b_rs, b_cs;
};

template <typename TIn, typename TOut>
__device__ void matmul_tile(const TIn* a, const TIn* b, TOut* out, int64_t m, int64_t n, int64_t p,
                            MatmulStrides st);

template <typename TIn, typename TOut>
__global__ void __launch_bounds__(kMmThreads)
    matmul_kernel(const TIn* a, const TIn* b, TOut* out, int64_t batch, int64_t m, int64_t n, int64_t p,
                  MatmulStrides st) {
  // Every thread of a block runs the same iterations, so the __syncthreads inside matmul_tile are reached by all.
  for (int64_t z = blockIdx.z; z < batch; z += gridDim.z) {
    matmul_tile(a + z * m * n, b + z * n * p, out + z * m * p, m, n, p, st);
  }
}

// This block's 64 x 64 tile of one product.
template <typename TIn, typename TOut>
__device__ void matmul_tile(const TIn* a, const TIn* b, TOut* out, int64_t m, int64_t n, int64_t p,
                            MatmulStrides st) {
  __shared__ float a_tile[kMmTileDepth][kMmATilePitch];
  __shared__ float b_tile[kMmTileDepth][kMmTileCols];

  const int tid = static_cast<int>(threadIdx.x);
  const int tx = tid % kMmThreadsX;
  const int ty = tid / kMmThreadsX;
  const int64_t row0 = int64_t(blockIdx.x) * kMmTileRows;  // first row of this block's tile of `out`
  const int64_t col0 = int64_t(blockIdx.y) * kMmTileCols;  // first column

  float acc[kMmThreadRows][kMmThreadCols] = {};
  for (int64_t k0 = 0; k0 < n; k0 += kMmTileDepth) {
    // Stage a[row0 : row0+64, k0 : k0+16] (consecutive threads read consecutive k: coalesced).
    for (int e = tid; e < kMmTileRows * kMmTileDepth; e += kMmThreads) {
      const int r = e / kMmTileDepth;
      const int k = e % kMmTileDepth;
      const int64_t gr = row0 + r;
      const int64_t gk = k0 + k;
      a_tile[k][r] = (gr < m && gk < n) ? to_float(a[gr * st.a_rs + gk * st.a_cs]) : 0.0f;
    }
    // Stage b[k0 : k0+16, col0 : col0+64] (consecutive threads read consecutive columns: coalesced).
    for (int e = tid; e < kMmTileDepth * kMmTileCols; e += kMmThreads) {
      const int k = e / kMmTileCols;
      const int c = e % kMmTileCols;
      const int64_t gk = k0 + k;
      const int64_t gc = col0 + c;
      b_tile[k][c] = (gk < n && gc < p) ? to_float(b[gk * st.b_rs + gc * st.b_cs]) : 0.0f;
    }
    __syncthreads();  // the slices are complete before anyone reads them

#pragma unroll
    for (int k = 0; k < kMmTileDepth; ++k) {
      float a_frag[kMmThreadRows];
      float b_frag[kMmThreadCols];
#pragma unroll
      for (int i = 0; i < kMmThreadRows; ++i) a_frag[i] = a_tile[k][ty + i * kMmThreadsY];
#pragma unroll
      for (int j = 0; j < kMmThreadCols; ++j) b_frag[j] = b_tile[k][tx + j * kMmThreadsX];
#pragma unroll
      for (int i = 0; i < kMmThreadRows; ++i) {
#pragma unroll
        for (int j = 0; j < kMmThreadCols; ++j) acc[i][j] += a_frag[i] * b_frag[j];
      }
    }
    __syncthreads();  // everyone is done reading before the next slice overwrites the tiles
  }

#pragma unroll
  for (int i = 0; i < kMmThreadRows; ++i) {
#pragma unroll
    for (int j = 0; j < kMmThreadCols; ++j) {
      const int64_t gr = row0 + ty + i * kMmThreadsY;
      const int64_t gc = col0 + tx + j * kMmThreadsX;
      if (gr < m && gc < p) out[gr * p + gc] = from_float<TOut>(acc[i][j]);
    }
  }
}

// The course's tiled layout: an (R, C) matrix stored as an (R/T, C/T, T, T) array, i.e. tile (ti, tj) is a
// compact T x T block at ((ti * (C/T) + tj) * T * T), and element (r, c) of a tile sits at r * T + c.
// a is (m/T, n/T, T, T), b is (n/T, p/T, T, T) and out is (m/T, p/T, T, T).  One thread per output element:
// simple rather than fast; `matmul` is the fast kernel.  float32 only.
constexpr int kTile = 8;

__global__ void matmul_tiled_kernel(const float* a, const float* b, float* out, int64_t m, int64_t n, int64_t p) {
  constexpr int64_t kTileElems = int64_t(kTile) * kTile;
  const int64_t n_tiles = n / kTile;
  const int64_t p_tiles = p / kTile;
  const int64_t total = m * p;
  for (int64_t e = first_index(); e < total; e += grid_stride()) {
    const int64_t tile = e / kTileElems;  // which tile of out: (ti, tj)
    const int64_t ti = tile / p_tiles;
    const int64_t tj = tile % p_tiles;
    const int r = static_cast<int>(e % kTileElems) / kTile;  // position inside that tile
    const int c = static_cast<int>(e % kTileElems) % kTile;
    float acc = 0.0f;
    for (int64_t kt = 0; kt < n_tiles; ++kt) {
      const float* a_tile = a + (ti * n_tiles + kt) * kTileElems;
      const float* b_tile = b + (kt * p_tiles + tj) * kTileElems;
#pragma unroll
      for (int k = 0; k < kTile; ++k) acc += a_tile[r * kTile + k] * b_tile[k * kTile + c];
    }
    out[e] = acc;
  }
}

// ---- Row gather / scatter (embeddings) --------------------------------------------------------------------
// Indices arrive in any dtype (TIdx), already checked on the host to be integers in range; to_index reads them.

// out[i, j] = a[idx[i], j]; one thread per output element, consecutive threads along a row (coalesced).
// A plain copy, so it works for every dtype (a and out of one dtype T).
template <typename T, typename TIdx>
__global__ void take_rows_kernel(const T* a, const TIdx* idx, T* out, int64_t n, int64_t row_size) {
  for (int64_t e = first_index(); e < n; e += grid_stride()) {
    const int64_t i = e / row_size;
    const int64_t j = e % row_size;
    out[e] = a[to_index(idx[i]) * row_size + j];
  }
}

// out[idx[i], j] += src[i, j] for i = 0, 1, 2, ... in order.  One thread per column j walks all i itself:
// with repeated indices, atomicAdd from many threads would sum in a different order each run (float addition
// is not associative), so results would not be reproducible.  Here every column is summed in index order,
// each addition rounded to T as a NumPy `out[r] += src[i]` would be.
template <typename T, typename TIdx>
__global__ void scatter_add_rows_kernel(const T* src, const TIdx* idx, T* out, int64_t num_idx, int64_t row_size) {
  for (int64_t j = first_index(); j < row_size; j += grid_stride()) {
    for (int64_t i = 0; i < num_idx; ++i) {
      T& target = out[to_index(idx[i]) * row_size + j];
      target = from_float<T>(to_float(target) + to_float(src[i * row_size + j]));
    }
  }
}

// out[i] = a[i, idx[i]] (a viewed as (n, row_size)): the logit at each row's label, with no one-hot matrix.
template <typename T, typename TIdx>
__global__ void take_along_rows_kernel(const T* a, const TIdx* idx, T* out, int64_t n, int64_t row_size) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    out[i] = a[i * row_size + to_index(idx[i])];
  }
}

// out[i, idx[i]] += src[i]: each row is touched by exactly one thread, so no atomics are needed.
template <typename T, typename TIdx>
__global__ void scatter_along_rows_kernel(const T* src, const TIdx* idx, T* out, int64_t n, int64_t row_size) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    T& target = out[i * row_size + to_index(idx[i])];
    target = from_float<T>(to_float(target) + to_float(src[i]));
  }
}

// ------------------------------------------------------------------------------------------------------------
// 7. Host wrappers
// ------------------------------------------------------------------------------------------------------------
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

// matmul / matmul_batched: a and b of one floating dtype, and out of that dtype too, or float32 for 16-bit a
// and b (the float32 accumulator kept rather than rounded to 16 bits).
void check_matmul_dtypes(const char* fn, const CudaArray& a, const CudaArray& b, const CudaArray& out) {
  const bool inputs_ok = dtype_info(a.dtype).floating && b.dtype == a.dtype;
  const bool out_ok = out.dtype == a.dtype || out.dtype == DType::kFloat32;
  if (!inputs_ok || !out_ok) {
    throw py::type_error(std::string("needle cuda: ") + fn +
                         ": expects floating a and b of one dtype and out of that dtype or float32, got " +
                         describe_dtypes({{"a", a}, {"b", b}, {"out", out}}));
  }
}

// ---- Views ------------------------------------------------------------------------------------------------

// Builds the kernel-side view and checks that every element it reaches lies inside a buffer of buffer_size.
// Returns the number of elements of the view in *count.
StridedView make_view(const char* fn, size_t buffer_size, const std::vector<int64_t>& shape,
                      const std::vector<int64_t>& strides, int64_t offset, int64_t* count) {
  if (shape.size() != strides.size()) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": shape and strides differ in length");
  }
  if (shape.size() > static_cast<size_t>(kMaxDims)) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": " + std::to_string(shape.size()) +
                          " dimensions, at most " + std::to_string(kMaxDims) + " are supported");
  }
  StridedView view{};
  view.ndim = static_cast<int>(shape.size());
  view.offset = offset;
  *count = 1;
  int64_t lowest = offset;  // smallest and largest buffer positions the view reaches
  int64_t highest = offset;
  for (int k = 0; k < view.ndim; ++k) {
    if (shape[k] < 0) throw py::value_error(std::string("needle cuda: ") + fn + ": negative shape");
    view.shape[k] = shape[k];
    view.strides[k] = strides[k];
    *count *= shape[k];
    if (shape[k] > 0) {
      const int64_t span = (shape[k] - 1) * strides[k];  // from idx_k = 0 to idx_k = shape_k - 1
      if (span < 0) {
        lowest += span;  // negative strides walk backwards
      } else {
        highest += span;
      }
    }
  }
  if (*count > 0 && (lowest < 0 || highest >= as_int64(buffer_size))) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": view reaches elements [" +
                          std::to_string(lowest) + ", " + std::to_string(highest) + "] of a buffer of " +
                          std::to_string(buffer_size) + " elements");
  }
  return view;
}

// One operand of an element-wise op on strided views: its strides and offset over the common shape, and the
// buffer it must stay inside.
struct Operand {
  const char* what;
  const std::vector<int64_t>* strides;
  int64_t offset;
  size_t buffer_size;
};

// Kernel-side views of N operands over one shape, simplified together (as the CPU backend does): dimensions
// of extent 1 are dropped, and neighbouring dimensions j, j+1 are merged when every operand has
// strides[j] == strides[j+1] * shape[j+1].  Neither changes which elements are visited nor their order, and
// fewer dimensions mean fewer divisions in strided_index (compact operands collapse to one dimension).
// Each simplified view is then checked against its buffer by make_view.  Returns the element count in *count.
template <int N>
void make_views(const char* fn, const std::vector<int64_t>& shape, const Operand (&ops)[N], StridedView (&views)[N],
                int64_t* count) {
  std::vector<int64_t> merged_shape;
  std::vector<int64_t> merged_strides[N];
  for (int k = 0; k < N; ++k) {
    if (ops[k].strides->size() != shape.size()) {
      throw py::value_error(std::string("needle cuda: ") + fn + ": " + ops[k].what +
                            " has strides of another rank than the shape");
    }
  }
  for (size_t j = 0; j < shape.size(); ++j) {
    if (shape[j] == 1) continue;
    bool merge = !merged_shape.empty() && shape[j] > 0 && merged_shape.back() > 0;
    for (int k = 0; k < N && merge; ++k) merge = merged_strides[k].back() == (*ops[k].strides)[j] * shape[j];
    if (merge) {
      merged_shape.back() *= shape[j];
      for (int k = 0; k < N; ++k) merged_strides[k].back() = (*ops[k].strides)[j];
    } else {
      merged_shape.push_back(shape[j]);
      for (int k = 0; k < N; ++k) merged_strides[k].push_back((*ops[k].strides)[j]);
    }
  }
  for (int k = 0; k < N; ++k) {
    views[k] = make_view(fn, ops[k].buffer_size, merged_shape, merged_strides[k], ops[k].offset, count);
  }
}

void check_out(const char* fn, const CudaArray& out, int64_t count, const CudaArray& a, const CudaArray* b) {
  check_size(fn, "out", out.size, static_cast<size_t>(count));
  if (out.size != 0 && (out.ptr == a.ptr || (b != nullptr && out.ptr == b->ptr))) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": out must not be one of the inputs");
  }
}

// ---- Strided element-wise (float32 only) ------------------------------------------------------------------

// Calls visit(op) with the functor of the binary operation named `name`.
template <typename Visit>
void with_binary_op(const char* fn, const std::string& name, Visit visit) {
  if (name == "add") return visit(AddOp());
  if (name == "sub") return visit(SubOp());
  if (name == "mul") return visit(MulOp());
  if (name == "div") return visit(DivOp());
  if (name == "power") return visit(PowerOp());
  if (name == "maximum") return visit(MaximumOp());
  if (name == "eq") return visit(EqOp());
  if (name == "ge") return visit(GeOp());
  if (name == "gt") return visit(GtOp());
  throw py::value_error(std::string("needle cuda: ") + fn + ": unknown op '" + name +
                        "' (expected add, sub, mul, div, power, maximum, eq, ge or gt)");
}

void ewise_strided(const std::string& op, const CudaArray& a, const std::vector<int64_t>& a_strides,
                   int64_t a_offset, const CudaArray& b, const std::vector<int64_t>& b_strides, int64_t b_offset,
                   CudaArray& out, const std::vector<int64_t>& shape) {
  check_float32("ewise_strided", {{"a", a}, {"b", b}, {"out", out}});
  const Operand ops[2] = {{"a", &a_strides, a_offset, a.size}, {"b", &b_strides, b_offset, b.size}};
  StridedView views[2];
  int64_t n = 0;
  make_views("ewise_strided", shape, ops, views, &n);
  check_out("ewise_strided", out, n, a, &b);
  with_binary_op("ewise_strided", op, [&](auto f) {
    if (n == 0) return;
    ewise_strided_kernel<<<grid_for(n), kBlockSize>>>(data<float>(a), views[0], data<float>(b), views[1],
                                                      data<float>(out), n, f);
    check_kernel("ewise_strided");
  });
}

void scalar_strided(const std::string& op, const CudaArray& a, const std::vector<int64_t>& strides, int64_t offset,
                    float val, CudaArray& out, const std::vector<int64_t>& shape) {
  check_float32("scalar_strided", {{"a", a}, {"out", out}});
  const Operand ops[1] = {{"a", &strides, offset, a.size}};
  StridedView views[1];
  int64_t n = 0;
  make_views("scalar_strided", shape, ops, views, &n);
  check_out("scalar_strided", out, n, a, nullptr);
  with_binary_op("scalar_strided", op, [&](auto f) {
    if (n == 0) return;
    scalar_strided_kernel<<<grid_for(n), kBlockSize>>>(data<float>(a), views[0], val, data<float>(out), n, f);
    check_kernel("scalar_strided");
  });
}

void unary_strided(const std::string& op, const CudaArray& a, const std::vector<int64_t>& strides, int64_t offset,
                   CudaArray& out, const std::vector<int64_t>& shape) {
  check_float32("unary_strided", {{"a", a}, {"out", out}});
  const Operand ops[1] = {{"a", &strides, offset, a.size}};
  StridedView views[1];
  int64_t n = 0;
  make_views("unary_strided", shape, ops, views, &n);
  check_out("unary_strided", out, n, a, nullptr);
  auto launch = [&](auto f) {
    if (n == 0) return;
    unary_strided_kernel<<<grid_for(n), kBlockSize>>>(data<float>(a), views[0], data<float>(out), n, f);
    check_kernel("unary_strided");
  };
  if (op == "log") return launch(LogOp());
  if (op == "exp") return launch(ExpOp());
  if (op == "tanh") return launch(TanhOp());
  throw py::value_error("needle cuda: unary_strided: unknown op '" + op + "' (expected log, exp or tanh)");
}

// ---- Copies and conversions (every dtype) -----------------------------------------------------------------

void compact(const CudaArray& a, CudaArray& out, const std::vector<int64_t>& shape,
             const std::vector<int64_t>& strides, int64_t offset) {
  int64_t n = 0;
  const StridedView view = make_view("compact", a.size, shape, strides, offset, &n);
  check_size("compact", "out", out.size, static_cast<size_t>(n));
  if (n == 0) return;  // a grid of zero blocks is an invalid launch
  visit_dtype(a.dtype, [&](auto in_tag) {
    visit_dtype(out.dtype, [&](auto out_tag) {
      using In = TypeOf<decltype(in_tag)>;
      using Out = TypeOf<decltype(out_tag)>;
      compact_kernel<<<grid_for(n), kBlockSize>>>(data<In>(a), data<Out>(out), n, view);
    });
  });
  check_kernel("compact");
}

void ewise_setitem(const CudaArray& a, CudaArray& out, const std::vector<int64_t>& shape,
                   const std::vector<int64_t>& strides, int64_t offset) {
  int64_t n = 0;
  const StridedView view = make_view("ewise_setitem", out.size, shape, strides, offset, &n);
  check_size("ewise_setitem", "a", a.size, static_cast<size_t>(n));
  if (n == 0) return;
  visit_dtype(a.dtype, [&](auto in_tag) {
    visit_dtype(out.dtype, [&](auto out_tag) {
      using In = TypeOf<decltype(in_tag)>;
      using Out = TypeOf<decltype(out_tag)>;
      ewise_setitem_kernel<<<grid_for(n), kBlockSize>>>(data<In>(a), data<Out>(out), n, view);
    });
  });
  check_kernel("ewise_setitem");
}

// The value of fill and scalar_setitem, read as the NumPy reference's `convert` reads it: an integer (a Python
// or NumPy int, or a bool) stays an integer, so an integer buffer receives it exactly (saturated); anything
// else is a float and becomes a float32 first, like every Python float in this module.
struct ScalarValue {
  bool is_integer;
  int64_t integer;  // when is_integer
  float real;       // otherwise
};

ScalarValue read_scalar(const py::object& val) {
  if (PyIndex_Check(val.ptr())) {  // ints, bools and NumPy integers; floats have no __index__
    const py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(val.ptr()));
    if (!index) throw py::error_already_set();
    int overflow = 0;
    const long long integer = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    if (overflow == 0) return {true, integer, 0.0f};
    // Past int64 it is read as a float (NumPy makes an object array of it, then a float32 of that).
  }
  const double real = PyFloat_AsDouble(val.ptr());
  if (real == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  return {false, 0, static_cast<float>(real)};
}

// That value in storage type T, converted once on the host with the kernels' own from_float.
template <typename T>
T scalar_to(const ScalarValue& val) {
  if (!val.is_integer) return from_float<T>(val.real);
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(std::clamp<int64_t>(val.integer, IntRange<T>::lo, IntRange<T>::hi));
  } else {
    return from_float<T>(static_cast<float>(val.integer));
  }
}

void scalar_setitem(size_t size, const py::object& val, CudaArray& out, const std::vector<int64_t>& shape,
                    const std::vector<int64_t>& strides, int64_t offset) {
  int64_t n = 0;
  const StridedView view = make_view("scalar_setitem", out.size, shape, strides, offset, &n);
  check_size("scalar_setitem", "the view", static_cast<size_t>(n), size);
  const ScalarValue value = read_scalar(val);
  if (n == 0) return;
  visit_dtype(out.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    scalar_setitem_kernel<<<grid_for(n), kBlockSize>>>(scalar_to<T>(value), data<T>(out), n, view);
  });
  check_kernel("scalar_setitem");
}

void fill(CudaArray& out, const py::object& val) {
  const ScalarValue value = read_scalar(val);
  const int64_t n = as_int64(out.size);
  if (n == 0) return;
  visit_dtype(out.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    fill_kernel<<<grid_for(n), kBlockSize>>>(data<T>(out), n, scalar_to<T>(value));
  });
  check_kernel("fill");
}

// uint32(seed * 0x9E3779B9), with seed = int(seed) as in the reference (any Python integer, or a float, which
// int() truncates).  It depends only on seed modulo 2^32, which PyLong_AsUnsignedLongLongMask gives for any
// integer (negative, or past 64 bits) in two's complement, as Python's `seed & 0xFFFFFFFF` would.
uint32_t seed_hash_of(const py::object& seed) {
  const py::int_ integer(seed);  // PyNumber_Long, i.e. int(seed); raises TypeError / ValueError otherwise
  return static_cast<uint32_t>(PyLong_AsUnsignedLongLongMask(integer.ptr())) * 0x9E3779B9u;
}

// float32 a -> bfloat16 out of the same size, rounded stochastically with the seed.
void round_stochastic(const CudaArray& a, CudaArray& out, const py::object& seed) {
  if (a.dtype != DType::kFloat32 || out.dtype != DType::kBFloat16 || a.size != out.size) {
    throw py::type_error("needle cuda: round_stochastic: expects float32 a and bfloat16 out of one size, got a " +
                         std::string(dtype_name(a.dtype)) + " (" + std::to_string(a.size) + "), out " +
                         dtype_name(out.dtype) + " (" + std::to_string(out.size) + ")");
  }
  const uint32_t seed_hash = seed_hash_of(seed);
  const int64_t n = as_int64(out.size);
  if (n == 0) return;
  round_stochastic_kernel<<<grid_for(n), kBlockSize>>>(data<float>(a), data<__nv_bfloat16>(out), n, seed_hash);
  check_kernel("round_stochastic");
}

void dropout(const CudaArray& a, CudaArray& out, double p, uint32_t seed) {
  check_floating("dropout", {{"a", a}, {"out", out}});
  check_size("dropout", "out", out.size, a.size);
  if (!(p >= 0.0 && p < 1.0)) throw py::value_error("dropout: p must be in [0, 1), got " + std::to_string(p));
  const int64_t n = as_int64(out.size);
  if (n == 0) return;
  const uint32_t threshold = static_cast<uint32_t>(std::min(p * 4294967296.0, 4294967295.0));
  visit_floating(out.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    dropout_kernel<<<grid_for(n), kBlockSize>>>(data<T>(a), data<T>(out), n, seed * 0x9E3779B9u, threshold,
                                                static_cast<float>(1.0 - p));
  });
  check_kernel("dropout");
}

// ---- Element-wise on compact arrays (floating dtypes) -----------------------------------------------------

template <typename Op>
void ewise_op(const char* name, const CudaArray& a, const CudaArray& b, CudaArray& out, Op op) {
  check_floating(name, {{"a", a}, {"b", b}, {"out", out}});
  check_size(name, "a", a.size, out.size);
  check_size(name, "b", b.size, out.size);
  const int64_t n = as_int64(out.size);
  if (n == 0) return;
  visit_floating(out.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    ewise_kernel<<<grid_for(n), kBlockSize>>>(data<T>(a), data<T>(b), data<T>(out), n, op);
  });
  check_kernel(name);
}

template <typename Op>
void scalar_op(const char* name, const CudaArray& a, float val, CudaArray& out, Op op) {
  check_floating(name, {{"a", a}, {"out", out}});
  check_size(name, "a", a.size, out.size);
  const int64_t n = as_int64(out.size);
  if (n == 0) return;
  visit_floating(out.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    scalar_kernel<<<grid_for(n), kBlockSize>>>(data<T>(a), val, data<T>(out), n, op);
  });
  check_kernel(name);
}

template <typename Op>
void unary_op(const char* name, const CudaArray& a, CudaArray& out, Op op) {
  check_floating(name, {{"a", a}, {"out", out}});
  check_size(name, "a", a.size, out.size);
  const int64_t n = as_int64(out.size);
  if (n == 0) return;
  visit_floating(out.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    unary_kernel<<<grid_for(n), kBlockSize>>>(data<T>(a), data<T>(out), n, op);
  });
  check_kernel(name);
}

// ---- Reductions (floating dtypes) -------------------------------------------------------------------------

// Threads for one row of reduce_size elements: enough whole warps to cover the row once, at most
// kReduceMaxThreads, so short rows do not idle 256 threads.
unsigned reduce_threads(size_t reduce_size) {
  const int64_t row_threads = ceil_div(std::max<int64_t>(as_int64(reduce_size), 1), kWarpSize) * kWarpSize;
  return static_cast<unsigned>(std::min<int64_t>(row_threads, kReduceMaxThreads));
}

template <typename Op>
void reduce_op(const char* name, const CudaArray& a, CudaArray& out, size_t reduce_size, Op op) {
  check_floating(name, {{"a", a}, {"out", out}});
  check_size(name, "a", a.size, out.size * reduce_size);
  const int64_t rows = as_int64(out.size);
  if (rows == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min(rows, kReduceMaxBlocks));
  visit_floating(out.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    reduce_kernel<<<blocks, reduce_threads(reduce_size)>>>(data<T>(a), data<T>(out), rows, as_int64(reduce_size),
                                                           op);
  });
  check_kernel(name);
}

void reduce_sum(const CudaArray& a, CudaArray& out, size_t reduce_size) {
  reduce_op("reduce_sum", a, out, reduce_size, SumReduce());  // an empty row sums to 0
}

void reduce_max(const CudaArray& a, CudaArray& out, size_t reduce_size) {
  if (reduce_size == 0 && out.size > 0) {  // as numpy: a maximum of nothing is an error, not -inf
    throw py::value_error("needle cuda: reduce_max: cannot take the maximum of an empty row");
  }
  reduce_op("reduce_max", a, out, reduce_size, MaxReduce());
}

// ---- Matrix multiplication --------------------------------------------------------------------------------

// Launches matmul_kernel for the dtypes of a, b and out (already checked by check_matmul_dtypes).
void launch_matmul(const dim3& grid, const CudaArray& a, const CudaArray& b, CudaArray& out, int64_t batch,
                   int64_t m, int64_t n, int64_t p, bool trans_a = false, bool trans_b = false) {
  const MatmulStrides st{trans_a ? 1 : n, trans_a ? m : 1, trans_b ? 1 : p, trans_b ? n : 1};
  visit_floating(a.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    if (out.dtype == a.dtype) {
      matmul_kernel<<<grid, kMmThreads>>>(data<T>(a), data<T>(b), data<T>(out), batch, m, n, p, st);
    } else {  // 16-bit a and b, float32 out
      matmul_kernel<<<grid, kMmThreads>>>(data<T>(a), data<T>(b), data<float>(out), batch, m, n, p, st);
    }
  });
}

// trans_a: a holds A's transpose, (n x m) row-major; trans_b: b holds B's (p x n).  The tiles read them in place.
void matmul(const CudaArray& a, const CudaArray& b, CudaArray& out, size_t m, size_t n, size_t p, bool trans_a,
            bool trans_b) {
  check_matmul_dtypes("matmul", a, b, out);
  check_size("matmul", "a", a.size, m * n);
  check_size("matmul", "b", b.size, n * p);
  check_size("matmul", "out", out.size, m * p);
  if (m == 0 || p == 0) return;  // nothing to write (n == 0 is fine: out becomes zeros)
  const int64_t col_blocks = ceil_div(as_int64(p), kMmTileCols);
  if (col_blocks > kMaxGridY) {
    throw py::value_error("needle cuda: matmul: p = " + std::to_string(p) + " columns is too many for the grid");
  }
  // Row tiles go in grid x (limit 2^31 - 1): tall matrices are the common case.
  const dim3 grid(static_cast<unsigned>(ceil_div(as_int64(m), kMmTileRows)), static_cast<unsigned>(col_blocks));
  launch_matmul(grid, a, b, out, 1, as_int64(m), as_int64(n), as_int64(p), trans_a, trans_b);
  check_kernel("matmul");
}

// out[i] = a[i] @ b[i] for a (batch, m, n), b (batch, n, p), out (batch, m, p): one launch, the batch in grid z.
void matmul_batched(const CudaArray& a, const CudaArray& b, CudaArray& out, size_t batch, size_t m, size_t n,
                    size_t p) {
  check_matmul_dtypes("matmul_batched", a, b, out);
  check_size("matmul_batched", "a", a.size, batch * m * n);
  check_size("matmul_batched", "b", b.size, batch * n * p);
  check_size("matmul_batched", "out", out.size, batch * m * p);
  if (out.size != 0 && (out.ptr == a.ptr || out.ptr == b.ptr)) {
    throw py::value_error("needle cuda: matmul_batched: out must not be one of the inputs");
  }
  if (out.size == 0) return;
  const int64_t col_blocks = ceil_div(as_int64(p), kMmTileCols);
  if (col_blocks > kMaxGridY) {
    throw py::value_error("needle cuda: matmul_batched: p = " + std::to_string(p) +
                          " columns is too many for the grid");
  }
  const dim3 grid(static_cast<unsigned>(ceil_div(as_int64(m), kMmTileRows)), static_cast<unsigned>(col_blocks),
                  static_cast<unsigned>(std::min<int64_t>(as_int64(batch), kMaxGridZ)));
  launch_matmul(grid, a, b, out, as_int64(batch), as_int64(m), as_int64(n), as_int64(p));
  check_kernel("matmul_batched");
}

void matmul_tiled(const CudaArray& a, const CudaArray& b, CudaArray& out, size_t m, size_t n, size_t p) {
  check_float32("matmul_tiled", {{"a", a}, {"b", b}, {"out", out}});
  constexpr size_t tile = kTile;
  if (m % tile != 0 || n % tile != 0 || p % tile != 0) {
    throw py::value_error("needle cuda: matmul_tiled: m, n, p must be multiples of " + std::to_string(kTile));
  }
  check_size("matmul_tiled", "a", a.size, m * n);
  check_size("matmul_tiled", "b", b.size, n * p);
  check_size("matmul_tiled", "out", out.size, m * p);
  const int64_t total = as_int64(m * p);
  if (total == 0) return;
  matmul_tiled_kernel<<<grid_for(total), kBlockSize>>>(data<float>(a), data<float>(b), data<float>(out),
                                                       as_int64(m), as_int64(n), as_int64(p));
  check_kernel("matmul_tiled");
}

// ---- Row gather / scatter ---------------------------------------------------------------------------------

// Formats an index value for an error message: 7 rather than 7.000000, but 2.5 and nan as they are.
std::string format_index(double value) {
  std::ostringstream s;
  if (std::isfinite(value) && value == std::floor(value)) {
    s << static_cast<long long>(value);
  } else {
    s << value;
  }
  return s.str();
}

// An index as the host reads it: exactly, int32 included (a double holds every value of every storage type).
template <typename T>
double index_value(T x) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<double>(x);
  } else {
    return static_cast<double>(to_float(x));
  }
}

// Copies the indices (of any dtype) to the host and checks each is an integer in [0, rows).  The copy waits for
// the device; that cost buys a Python IndexError *before* any kernel could read out of bounds.
void check_row_indices(const char* fn, const CudaArray& idx, int64_t rows) {
  if (idx.size == 0) return;
  visit_dtype(idx.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    std::vector<T> host(idx.size);
    check_cuda(cudaMemcpy(host.data(), idx.ptr, idx.size * sizeof(T), cudaMemcpyDeviceToHost),
               "cudaMemcpy (reading row indices)");
    for (size_t i = 0; i < host.size(); ++i) {
      const double v = index_value(host[i]);
      if (!std::isfinite(v) || v != std::floor(v)) {
        throw py::index_error(std::string("needle cuda: ") + fn + ": index " + format_index(v) + " (idx[" +
                              std::to_string(i) + "]) is not an integer");
      }
      if (v < 0.0 || v >= static_cast<double>(rows)) {  // double: exact for any row count
        throw py::index_error(std::string("needle cuda: ") + fn + ": index " + format_index(v) + " (idx[" +
                              std::to_string(i) + "]) is out of range for " + std::to_string(rows) + " rows");
      }
    }
  });
}

// Calls launch(TypeTag<T>(), TypeTag<TIdx>()) for the floating dtype of the data and any dtype of idx.
template <typename Launch>
void visit_floating_and_index(DType data_dtype, DType idx_dtype, Launch&& launch) {
  visit_floating(data_dtype, [&](auto data_tag) {
    visit_dtype(idx_dtype, [&](auto idx_tag) { launch(data_tag, idx_tag); });
  });
}

void take_rows(const CudaArray& a, const CudaArray& idx, CudaArray& out, size_t row_size) {
  if (a.dtype != out.dtype) {
    throw py::type_error("needle cuda: take_rows: expects a and out of one dtype, got " +
                         describe_dtypes({{"a", a}, {"out", out}}));
  }
  if (row_size == 0) throw py::value_error("needle cuda: take_rows: row_size must be positive");
  if (a.size % row_size != 0) {
    throw py::value_error("needle cuda: take_rows: a has " + std::to_string(a.size) +
                          " elements, not a multiple of row_size " + std::to_string(row_size));
  }
  check_size("take_rows", "out", out.size, idx.size * row_size);
  check_row_indices("take_rows", idx, as_int64(a.size / row_size));
  const int64_t n = as_int64(out.size);
  if (n == 0) return;
  // A copy: every dtype of a (not only the floating ones), with indices of every dtype.
  visit_dtype(a.dtype, [&](auto data_tag) {
    visit_dtype(idx.dtype, [&](auto idx_tag) {
      using T = TypeOf<decltype(data_tag)>;
      using TIdx = TypeOf<decltype(idx_tag)>;
      take_rows_kernel<<<grid_for(n), kBlockSize>>>(data<T>(a), data<TIdx>(idx), data<T>(out), n,
                                                    as_int64(row_size));
    });
  });
  check_kernel("take_rows");
}

void scatter_add_rows(const CudaArray& src, const CudaArray& idx, CudaArray& out, size_t row_size) {
  check_floating("scatter_add_rows", {{"src", src}, {"out", out}});
  if (row_size == 0) throw py::value_error("needle cuda: scatter_add_rows: row_size must be positive");
  if (out.size % row_size != 0) {
    throw py::value_error("needle cuda: scatter_add_rows: out has " + std::to_string(out.size) +
                          " elements, not a multiple of row_size " + std::to_string(row_size));
  }
  check_size("scatter_add_rows", "src", src.size, idx.size * row_size);
  check_row_indices("scatter_add_rows", idx, as_int64(out.size / row_size));
  if (idx.size == 0) return;
  const int64_t columns = as_int64(row_size);
  visit_floating_and_index(out.dtype, idx.dtype, [&](auto data_tag, auto idx_tag) {
    using T = TypeOf<decltype(data_tag)>;
    using TIdx = TypeOf<decltype(idx_tag)>;
    scatter_add_rows_kernel<<<grid_for(columns), kBlockSize>>>(data<T>(src), data<TIdx>(idx), data<T>(out),
                                                               as_int64(idx.size), columns);
  });
  check_kernel("scatter_add_rows");
}

// Threads per row as reduce_op chooses them, blocks up to kReduceMaxBlocks (grid-stride over more rows).
// Without idx, g and grad (reduce_logsumexp) TIdx is float and idx is nullptr.
template <typename T, typename TIdx>
void logsumexp_rows(const char* name, const T* a, T* lse, const TIdx* idx, const T* g, T* grad, int64_t rows,
                    size_t reduce_size) {
  if (rows == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min(rows, kReduceMaxBlocks));
  logsumexp_rows_kernel<<<blocks, reduce_threads(reduce_size)>>>(a, lse, idx, g, grad, rows, as_int64(reduce_size));
  check_kernel(name);
}

void reduce_logsumexp(const CudaArray& a, CudaArray& out, size_t reduce_size) {
  check_floating("reduce_logsumexp", {{"a", a}, {"out", out}});
  if (reduce_size == 0 && out.size > 0) {
    throw py::value_error("needle cuda: reduce_logsumexp: cannot reduce over zero elements");
  }
  check_size("reduce_logsumexp", "a", a.size, out.size * reduce_size);
  visit_floating(a.dtype, [&](auto tag) {
    using T = TypeOf<decltype(tag)>;
    logsumexp_rows<T, float>("reduce_logsumexp", data<T>(a), data<T>(out), nullptr, nullptr, nullptr,
                             as_int64(out.size), reduce_size);
  });
}

void softmax_xent_grad(const CudaArray& a, const CudaArray& idx, const CudaArray& g, CudaArray& out,
                       size_t row_size) {
  check_floating("softmax_xent_grad", {{"a", a}, {"g", g}, {"out", out}});
  if (row_size == 0) throw py::value_error("needle cuda: softmax_xent_grad: row_size must be positive");
  check_size("softmax_xent_grad", "a", a.size, idx.size * row_size);
  check_size("softmax_xent_grad", "g", g.size, idx.size);
  check_size("softmax_xent_grad", "out", out.size, idx.size * row_size);
  check_row_indices("softmax_xent_grad", idx, as_int64(row_size));
  visit_floating_and_index(a.dtype, idx.dtype, [&](auto data_tag, auto idx_tag) {
    using T = TypeOf<decltype(data_tag)>;
    using TIdx = TypeOf<decltype(idx_tag)>;
    logsumexp_rows<T, TIdx>("softmax_xent_grad", data<T>(a), nullptr, data<TIdx>(idx), data<T>(g), data<T>(out),
                            as_int64(idx.size), row_size);
  });
}

void take_along_rows(const CudaArray& a, const CudaArray& idx, CudaArray& out, size_t row_size) {
  check_floating("take_along_rows", {{"a", a}, {"out", out}});
  if (row_size == 0) throw py::value_error("needle cuda: take_along_rows: row_size must be positive");
  check_size("take_along_rows", "a", a.size, idx.size * row_size);
  check_size("take_along_rows", "out", out.size, idx.size);
  check_row_indices("take_along_rows", idx, as_int64(row_size));
  const int64_t n = as_int64(idx.size);
  if (n == 0) return;
  visit_floating_and_index(a.dtype, idx.dtype, [&](auto data_tag, auto idx_tag) {
    using T = TypeOf<decltype(data_tag)>;
    using TIdx = TypeOf<decltype(idx_tag)>;
    take_along_rows_kernel<<<grid_for(n), kBlockSize>>>(data<T>(a), data<TIdx>(idx), data<T>(out), n,
                                                        as_int64(row_size));
  });
  check_kernel("take_along_rows");
}

void scatter_along_rows(const CudaArray& src, const CudaArray& idx, CudaArray& out, size_t row_size) {
  check_floating("scatter_along_rows", {{"src", src}, {"out", out}});
  if (row_size == 0) throw py::value_error("needle cuda: scatter_along_rows: row_size must be positive");
  check_size("scatter_along_rows", "out", out.size, idx.size * row_size);
  check_size("scatter_along_rows", "src", src.size, idx.size);
  check_row_indices("scatter_along_rows", idx, as_int64(row_size));
  const int64_t n = as_int64(idx.size);
  if (n == 0) return;
  visit_floating_and_index(out.dtype, idx.dtype, [&](auto data_tag, auto idx_tag) {
    using T = TypeOf<decltype(data_tag)>;
    using TIdx = TypeOf<decltype(idx_tag)>;
    scatter_along_rows_kernel<<<grid_for(n), kBlockSize>>>(data<T>(src), data<TIdx>(idx), data<T>(out), n,
                                                           as_int64(row_size));
  });
  check_kernel("scatter_along_rows");
}

// ---- Block-wise 8-bit quantization ------------------------------------------------------------------------

// quantize_blockwise / dequantize_blockwise take exactly one dtype per argument.
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

// ceil(n / block_size), the number of quantization blocks (written so that no block_size can overflow it).
int64_t num_quantization_blocks(const char* fn, size_t n, int64_t block_size) {
  if (block_size < 1) {
    throw py::value_error(std::string("needle cuda: ") + fn + ": block_size must be at least 1, got " +
                          std::to_string(block_size));
  }
  return as_int64(n) / block_size + (as_int64(n) % block_size != 0 ? 1 : 0);
}

void quantize_blockwise(const CudaArray& a, const CudaArray& code, CudaArray& out, CudaArray& absmax,
                        int64_t block_size) {
  const char* fn = "quantize_blockwise";
  const int64_t blocks = num_quantization_blocks(fn, a.size, block_size);
  check_exact_dtypes(fn, {{"a", a, DType::kFloat32},
                          {"code", code, DType::kFloat32},
                          {"out", out, DType::kUInt8},
                          {"absmax", absmax, DType::kFloat32}});
  check_size(fn, "code", code.size, kCodeSize);
  check_size(fn, "out", out.size, a.size);
  check_size(fn, "absmax", absmax.size, static_cast<size_t>(blocks));
  if (blocks == 0) return;
  const unsigned grid = static_cast<unsigned>(std::min(blocks, kReduceMaxBlocks));
  quantize_blockwise_kernel<<<grid, reduce_threads(static_cast<size_t>(block_size))>>>(
      data<float>(a), data<float>(code), data<uint8_t>(out), data<float>(absmax), as_int64(a.size), block_size,
      blocks);
  check_kernel(fn);
}

void dequantize_blockwise(const CudaArray& q, const CudaArray& code, const CudaArray& absmax, CudaArray& out,
                          int64_t block_size) {
  const char* fn = "dequantize_blockwise";
  const int64_t blocks = num_quantization_blocks(fn, q.size, block_size);
  check_exact_dtypes(fn, {{"q", q, DType::kUInt8},
                          {"code", code, DType::kFloat32},
                          {"absmax", absmax, DType::kFloat32},
                          {"out", out, DType::kFloat32}});
  check_size(fn, "code", code.size, kCodeSize);
  check_size(fn, "absmax", absmax.size, static_cast<size_t>(blocks));
  check_size(fn, "out", out.size, q.size);
  const int64_t n = as_int64(q.size);
  if (n == 0) return;
  dequantize_blockwise_kernel<<<grid_for(n), kBlockSize>>>(data<uint8_t>(q), data<float>(code), data<float>(absmax),
                                                           data<float>(out), n, block_size);
  check_kernel(fn);
}

void adam_step(const CudaArray& theta, const CudaArray& grad, const CudaArray& m, const CudaArray& v, CudaArray& out,
               CudaArray& out_m, CudaArray& out_v, bool first, double lr, double beta1, double beta2, double eps,
               double correction1, double correction2) {
  const char* fn = "adam_step";
  check_exact_dtypes(fn, {{"theta", theta, DType::kFloat32},
                          {"grad", grad, DType::kFloat32},
                          {"m", m, DType::kFloat32},
                          {"v", v, DType::kFloat32},
                          {"out", out, DType::kFloat32},
                          {"out_m", out_m, DType::kFloat32},
                          {"out_v", out_v, DType::kFloat32}});
  for (const auto& [name, size] : {std::pair<const char*, size_t>{"grad", grad.size}, {"m", m.size}, {"v", v.size},
                                   {"out", out.size}, {"out_m", out_m.size}, {"out_v", out_v.size}})
    check_size(fn, name, size, theta.size);
  const int64_t n = as_int64(theta.size);
  if (n == 0) return;
  adam_step_kernel<<<grid_for(n), kBlockSize>>>(data<float>(theta), data<float>(grad), data<float>(m), data<float>(v),
                                                data<float>(out), data<float>(out_m), data<float>(out_v), n, first,
                                                adam_hyper(lr, beta1, beta2, eps, correction1, correction2));
  check_kernel(fn);
}

void adam8bit_step(const CudaArray& theta, const CudaArray& grad, CudaArray& q_m, CudaArray& absmax_m, CudaArray& q_v,
                   CudaArray& absmax_v, const CudaArray& code_m, const CudaArray& code_v, CudaArray& out,
                   int64_t block_size, double lr, double beta1, double beta2, double eps, double correction1,
                   double correction2) {
  const char* fn = "adam8bit_step";
  const int64_t blocks = num_quantization_blocks(fn, theta.size, block_size);
  check_exact_dtypes(fn, {{"theta", theta, DType::kFloat32},
                          {"grad", grad, DType::kFloat32},
                          {"q_m", q_m, DType::kUInt8},
                          {"absmax_m", absmax_m, DType::kFloat32},
                          {"q_v", q_v, DType::kUInt8},
                          {"absmax_v", absmax_v, DType::kFloat32},
                          {"code_m", code_m, DType::kFloat32},
                          {"code_v", code_v, DType::kFloat32},
                          {"out", out, DType::kFloat32}});
  check_size(fn, "grad", grad.size, theta.size);
  check_size(fn, "q_m", q_m.size, theta.size);
  check_size(fn, "q_v", q_v.size, theta.size);
  check_size(fn, "out", out.size, theta.size);
  check_size(fn, "absmax_m", absmax_m.size, static_cast<size_t>(blocks));
  check_size(fn, "absmax_v", absmax_v.size, static_cast<size_t>(blocks));
  check_size(fn, "code_m", code_m.size, kCodeSize);
  check_size(fn, "code_v", code_v.size, kCodeSize);
  if (blocks == 0) return;
  const AdamHyper h = adam_hyper(lr, beta1, beta2, eps, correction1, correction2);
  const unsigned grid = static_cast<unsigned>(std::min(blocks, kReduceMaxBlocks));
  adam8bit_step_kernel<<<grid, reduce_threads(static_cast<size_t>(block_size))>>>(
      data<float>(theta), data<float>(grad), data<uint8_t>(q_m), data<float>(absmax_m), data<uint8_t>(q_v),
      data<float>(absmax_v), data<float>(code_m), data<float>(code_v), data<float>(out), as_int64(theta.size),
      block_size, blocks, h);
  check_kernel(fn);
}

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
// relies on that order, see the top of this file), so each copy is tied to it by events:
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

// Binding helpers: one per family of element-wise functions, so the table in the module body is one line per
// function.  `name` is a string literal (static lifetime), captured for the error messages.
template <typename Op>
void def_ewise(py::module_& m, const char* name, Op op) {
  m.def(name, [name, op](const CudaArray& a, const CudaArray& b, CudaArray& out) { ewise_op(name, a, b, out, op); });
}

template <typename Op>
void def_scalar(py::module_& m, const char* name, Op op) {
  m.def(name, [name, op](const CudaArray& a, float val, CudaArray& out) { scalar_op(name, a, val, out, op); });
}

template <typename Op>
void def_unary(py::module_& m, const char* name, Op op) {
  m.def(name, [name, op](const CudaArray& a, CudaArray& out) { unary_op(name, a, out, op); });
}

}  // namespace cuda
}  // namespace needle

#include "cuda/attention.cuh"  // fused attention (FlashAttention-2): attention_forward, attention_backward
#include "cuda/layernorm.cuh"  // fused layer norm: layernorm_forward, layernorm_backward

// ------------------------------------------------------------------------------------------------------------
// 8. Bindings
// ------------------------------------------------------------------------------------------------------------

PYBIND11_MODULE(ndarray_backend_cuda, m) {
  using namespace needle::cuda;
  m.doc() = "needle CUDA backend: flat device buffers (float32, float16, bfloat16, int8, uint8, int32) and the "
            "kernels of src/README.md";
  m.attr("__device_name__") = "cuda";
  m.attr("__tile_size__") = kTile;

  // OutOfMemory -> MemoryError (pybind11 has no built-in C++ type for it).  Local: only this module's calls.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const OutOfMemory& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    }
  });

  py::class_<CudaArray>(m, "Array")
      .def(py::init<size_t, const std::string&>(), py::arg("size"), py::arg("dtype") = "float32")
      .def("ptr", &CudaArray::ptr_as_int)
      .def_readonly("size", &CudaArray::size)
      .def_property_readonly("dtype", [](const CudaArray& a) { return dtype_name(a.dtype); })
      .def_readonly("itemsize", &CudaArray::itemsize);

  m.def("to_numpy", to_numpy);
  m.def("from_numpy", from_numpy);
  m.def("pinned_empty", pinned_empty);
  m.def("copy_to_host_async", copy_to_host_async);
  m.def("copy_from_host_async", copy_from_host_async);
  m.def("wait_copy", wait_copy);
  m.def("synchronize_copies", synchronize_copies);
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

  def_ewise(m, "ewise_add", AddOp());
  def_ewise(m, "ewise_mul", MulOp());
  def_ewise(m, "ewise_div", DivOp());
  def_ewise(m, "ewise_maximum", MaximumOp());
  def_ewise(m, "ewise_eq", EqOp());
  def_ewise(m, "ewise_ge", GeOp());
  def_ewise(m, "ewise_gt", GtOp());
  def_ewise(m, "ewise_power", PowerOp());

  def_scalar(m, "scalar_add", AddOp());
  def_scalar(m, "scalar_mul", MulOp());
  def_scalar(m, "scalar_div", DivOp());
  def_scalar(m, "scalar_power", PowerOp());
  def_scalar(m, "scalar_maximum", MaximumOp());
  def_scalar(m, "scalar_eq", EqOp());
  def_scalar(m, "scalar_ge", GeOp());
  def_scalar(m, "scalar_gt", GtOp());

  def_unary(m, "ewise_log", LogOp());
  def_unary(m, "ewise_exp", ExpOp());
  def_unary(m, "ewise_tanh", TanhOp());

  m.def("ewise_strided", ewise_strided);
  m.def("scalar_strided", scalar_strided);
  m.def("unary_strided", unary_strided);

  m.def("matmul", matmul, py::arg("a"), py::arg("b"), py::arg("out"), py::arg("m"), py::arg("n"), py::arg("p"),
        py::arg("trans_a") = false, py::arg("trans_b") = false);
  m.def("matmul_batched", matmul_batched);
  m.def("matmul_tiled", matmul_tiled);
  m.def("reduce_sum", reduce_sum);
  m.def("reduce_max", reduce_max);
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

  m.def("memory_stats", [] {
    const CachingAllocator& alloc = allocator();
    py::dict stats;
    stats["current_bytes"] = alloc.current_bytes();
    stats["peak_bytes"] = alloc.peak_bytes();
    stats["allocations"] = alloc.live_arrays();
    stats["reserved_bytes"] = alloc.reserved_bytes();
    return stats;
  });
  m.def("reset_peak_memory_stats", [] { allocator().reset_peak(); });
  m.def("set_memory_limit", [](size_t nbytes) { allocator().set_limit(nbytes); }, py::arg("nbytes"));
  m.def("empty_cache", [] { allocator().empty_cache(); });
  m.def("device_count", device_count);
}
