// ndarray_backend_cuda.cu -- the CUDA backend of needle: the pybind11 module `ndarray_backend_cuda`.
//
// Python (python/needle/backend_ndarray/ndarray.py) owns shapes, strides and offsets; this module only ever
// sees flat device buffers of one dtype each plus the (shape, strides, offset) of a view.  src/README.md is the
// contract: every function here has the same name and arguments as in ndarray_backend_cpu.cc, so Python never
// branches on the device.  All strides and offsets are counted in elements, not bytes.
//
// The code lives in src/cuda/, one header per concern, each read top to bottom (kernels, then the host
// wrappers: cheap argument checks on the host, then one kernel launch each):
//   common.cuh          errors (a failed launch raises a Python exception naming the kernel), launch helpers,
//                       device_count
//   dtypes.cuh          the six storage types, the conversions between them and float32, and the one switch
//                       that turns a run-time dtype into a compile-time type
//   array.cuh           CudaArray (the `Array` Python sees), the caching allocator, the dtype checks
//   strided.cuh         strided views; compact, ewise_setitem, scalar_setitem, fill
//   random.cuh          round_stochastic and dropout (counter-based: a hash of the index and the seed)
//   elementwise.cuh     ewise_*, scalar_*, ewise_log/exp/tanh, and their strided variants
//   gather_scatter.cuh  take_rows, scatter_add_rows, take_along_rows, scatter_along_rows
//   reduce.cuh          reduce_sum, reduce_max, reduce_logsumexp, softmax_xent_grad; block_reduce
//   matmul.cuh          matmul (operands read transposed in place), matmul_batched, matmul_tiled
//   quantize.cuh        block-wise 8-bit quantization
//   optimizer.cuh       sgd_step, adam_step, adam8bit_step
//   adafactor.cuh       Adafactor's passes: adafactor_moments, adafactor_sumsq, adafactor_step
//   attention.cuh       fused attention (FlashAttention-2): attention_forward, attention_backward
//   layernorm.cuh       fused layer norm: layernorm_forward, layernorm_backward
//   activations.cuh     GELU (exact, tanh), SiLU and their derivatives: functors for ewise_gelu, ..., ewise_silu_grad
//   fewbit.cuh          k-bit codes of an activation's input, packed: pack_codes, unpack_scale
//   compress.cuh        k-bit linear codes with stochastic rounding: quantize_stochastic, dequantize_linear
//   host_copy.cuh       to_numpy / from_numpy; pinned host memory and asynchronous copies on a copy stream
// Each header includes what it uses and compiles on its own; together they are this one translation unit
// (their functions are not `inline`: include them from here only).
//
// Everything runs on the legacy default stream, so kernels execute in the order they were issued.  That is
// what makes the caching allocator safe without any events (array.cuh).
//
// Nothing runs on the GPU at import time.  The first CUDA call happens when device_count() is called or an
// Array of non-zero size is created, so `import ndarray_backend_cuda` works on machines without a GPU.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // std::vector arguments (shapes, strides)

#include <exception>

#include "cuda/activations.cuh"
#include "cuda/adafactor.cuh"
#include "cuda/array.cuh"
#include "cuda/attention.cuh"
#include "cuda/common.cuh"
#include "cuda/dtypes.cuh"
#include "cuda/fewbit.cuh"
#include "cuda/compress.cuh"
#include "cuda/elementwise.cuh"
#include "cuda/gather_scatter.cuh"
#include "cuda/host_copy.cuh"
#include "cuda/layernorm.cuh"
#include "cuda/matmul.cuh"
#include "cuda/optimizer.cuh"
#include "cuda/quantize.cuh"
#include "cuda/random.cuh"
#include "cuda/reduce.cuh"
#include "cuda/strided.cuh"

namespace needle {
namespace cuda {

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

// ---- Bindings ---------------------------------------------------------------------------------------------

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
  m.def("sgd_step", sgd_step);
  m.def("adafactor_moments", adafactor_moments);
  m.def("adafactor_sumsq", adafactor_sumsq);
  m.def("adafactor_step", adafactor_step);
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
  def_unary(m, "ewise_gelu", GeluOp());
  def_unary(m, "ewise_gelu_tanh", GeluTanhOp());
  def_unary(m, "ewise_silu", SiluOp());
  def_ewise(m, "ewise_gelu_grad", GeluGradOp());
  def_ewise(m, "ewise_gelu_tanh_grad", GeluTanhGradOp());
  def_ewise(m, "ewise_silu_grad", SiluGradOp());
  m.def("pack_codes", pack_codes);
  m.def("unpack_scale", unpack_scale);
  m.def("quantize_stochastic", quantize_stochastic);
  m.def("dequantize_linear", dequantize_linear);

  m.def("ewise_strided", ewise_strided);
  m.def("scalar_strided", scalar_strided);
  m.def("unary_strided", unary_strided);

  m.def("matmul", matmul, py::arg("a"), py::arg("b"), py::arg("out"), py::arg("m"), py::arg("n"), py::arg("p"),
        py::arg("trans_a") = false, py::arg("trans_b") = false, py::arg("accumulate") = false);
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
