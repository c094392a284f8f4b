// needle's C++ CPU backend: the pybind11 module `ndarray_backend_cpu`.
//
// It implements exactly the functions listed in src/README.md (the NumPy module ndarray_backend_numpy.py is the
// executable specification).  Python owns shape / strides / offset; this module only ever sees flat buffers of
// one dtype each (`Array`) plus the (shape, strides, offset) of a view, all in *elements*.  Python checks every
// view before it gets here; we still check cheap invariants (sizes, view bounds, index ranges) and raise Python
// exceptions (ValueError / IndexError / TypeError / MemoryError) instead of crashing.
//
// This file is the module definition only: the bindings.  The kernels live in src/cpu/, one concern a header,
// each including what it uses (the module is this one translation unit, so their functions are `static`):
//
//   common.h          scalar_t, ALIGNMENT, and the ValueError helpers fail / check_size
//   dtypes.h          the storage dtypes, float16 / bfloat16 conversions, visit_float / visit_any
//   allocator.h       Arena: mapped pages carved into blocks, free ranges split, coalesced and given back
//   array.h           Array and its allocator's policy (what stays resident, the trimmer), memory_stats & co.
//   threads.h         num_threads, threads_for, parallel_range (OpenMP)
//   walk.h            walking strided views: Walk, make_walk, for_each_run
//   views.h           compact (astype), ewise_setitem, scalar_setitem, to_numpy(_into), from_numpy, fill
//   copy_thread.h     copy_thread_to_host, copy_thread_to_device, copy_thread_wait: offloading's copies beside compute
//   random.h          the counter-based hash lowbias32: dropout, round_stochastic
//   quantize.h        block-wise 8-bit quantization: quantize_blockwise, dequantize_blockwise
//   adam.h            the optimizer kernels: sgd_step, adam_step, adam8bit_step
//   simd.h            GCC vector types, the instruction sets of this build (NEEDLE_X86_DISPATCH), cpu_has
//   vector_math.h     exp, log, tanh, row sum / max / sum of exp for 4, 8 or 16 lanes, chosen at import
//   elementwise.h     ewise_* / scalar_* on compact buffers, ewise_strided / scalar_strided / unary_strided
//   reduce.h          reduce_sum, reduce_max, reduce_logsumexp
//   gather.h          take_rows, scatter_add_rows, take_along_rows, scatter_along_rows
//   cross_entropy.h   softmax_xent_grad
//   matmul_kernels.h  the float32 micro-kernels (generic, AVX2, AVX-512) and the packing of their panels
//   matmul_bf16.h     the bfloat16 micro-kernel on VDPBF16PS (AVX512-BF16) and its panels of pairs
//   matmul_gemm.h     the packed GEMM (Goto/BLIS) and the small-product paths; the choice of kernel
//   adafactor.h       Adafactor's passes: adafactor_moments, adafactor_sumsq, adafactor_step
//   matmul.h          matmul, matmul_batched, matmul_tiled
//   attention.h       fused attention (FlashAttention-2): attention_forward, attention_backward
//   layernorm.h       fused layer norm: layernorm_forward, layernorm_backward
//   activations.h     GELU (exact, tanh) and SiLU and their derivatives: ewise_gelu, ..., ewise_silu_grad
//   fewbit.h          k-bit codes of an activation's input, packed: pack_codes, unpack_scale
//   compress.h        k-bit linear codes with stochastic rounding: quantize_stochastic, dequantize_linear

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // the std::vector<int64_t> shapes and strides

#include <exception>
#include <memory>
#include <pthread.h>
#include <string>
#include <vector>

// In the order of the list above, where each header uses only headers above it.
#include "cpu/common.h"
#include "cpu/dtypes.h"
#include "cpu/array.h"
#include "cpu/threads.h"
#include "cpu/walk.h"
#include "cpu/views.h"
#include "cpu/random.h"
#include "cpu/quantize.h"
#include "cpu/adam.h"
#include "cpu/vector_math.h"
#include "cpu/elementwise.h"
#include "cpu/reduce.h"
#include "cpu/gather.h"
#include "cpu/cross_entropy.h"
#include "cpu/matmul_gemm.h"
#include "cpu/adafactor.h"
#include "cpu/matmul.h"
#include "cpu/attention.h"
#include "cpu/layernorm.h"
#include "cpu/activations.h"
#include "cpu/fewbit.h"
#include "cpu/compress.h"
#include "cpu/copy_thread.h"

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
      .def_property_readonly("is_alias", &Array::is_alias)
      .def_readonly("size", &Array::size)
      .def_readonly("itemsize", &Array::itemsize)
      .def_property_readonly("dtype", &Array::dtype_name);

  // ndl.jit.capture's static memory plan. unplaced_array: an array of `size` elements of `dtype` with no bytes
  // yet (nothing may touch it before place_in_arena). place_in_arena: the blocks of the arrays placed are given
  // back first, then one arena of `nbytes` is allocated and each array (handle, offset) made an alias into it, so
  // nothing is held twice; returns the arena. A replayed step then writes where the plan put each array.
  m.def(
      "unplaced_array",
      [](size_t size, const std::string& dtype) { return new Array(size, parse_dtype(dtype), Array::Unallocated{}); },
      py::return_value_policy::take_ownership, py::arg("size"), py::arg("dtype"));
  m.def(
      "place_in_arena",
      [](size_t nbytes, const py::list& placements) {
        size_t owned = 0;  // bytes the arrays give back: under a memory limit the arena must fit once they have
        for (const auto& item : placements) {
          const Array& a = item.cast<py::tuple>()[0].cast<const Array&>();
          if (a.owns) owned += a.size * a.itemsize;
        }
        {
          MemoryStats& s = stats();
          std::lock_guard<std::mutex> lock(s.mu);
          const size_t held = s.current_bytes - std::min(owned, s.current_bytes);
          if (s.limit_bytes != 0 && nbytes > s.limit_bytes - std::min(s.limit_bytes, held)) {
            std::ostringstream msg;
            msg << "needle cpu: cannot allocate a captured step's arena of " << nbytes << " bytes: " << held
                << " bytes held besides what it replaces, limit " << s.limit_bytes << " bytes";
            throw NeedleMemoryError(msg.str());  // (before anything is given back: every value is still there)
          }
        }
        std::vector<Array*> released;
        for (const auto& item : placements) {
          Array& a = item.cast<py::tuple>()[0].cast<Array&>();
          if (a.owns) released.push_back(&a);
          a.give_back_block();
        }
        py::object arena;
        try {
          arena = py::cast(new Array(std::max<size_t>(1, (nbytes + 3) / 4)), py::return_value_policy::take_ownership);
        } catch (...) {  // (the system refused: each array gets a block of its own again, its values lost)
          for (Array* a : released) a->acquire_block();
          throw;
        }
        for (const auto& item : placements) {
          const py::tuple placement = item.cast<py::tuple>();
          placement[0].cast<Array&>().alias_into(arena, placement[1].cast<size_t>());
        }
        return arena;
      },
      py::arg("nbytes"), py::arg("placements"));
  m.def("to_numpy", to_numpy);
  m.def("to_numpy_into", to_numpy_into);
  m.def("from_numpy", from_numpy);
  m.def("copy_thread_to_host", copy_thread_to_host);
  m.def("copy_thread_to_device", copy_thread_to_device);
  m.def("copy_thread_wait", copy_thread_wait);
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
  m.def("ewise_gelu", ewise_gelu);
  m.def("ewise_gelu_tanh", ewise_gelu_tanh);
  m.def("ewise_silu", ewise_silu);
  m.def("ewise_gelu_grad", ewise_gelu_grad);
  m.def("ewise_gelu_tanh_grad", ewise_gelu_tanh_grad);
  m.def("ewise_silu_grad", ewise_silu_grad);
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
