// common.h -- what every part of the C++ CPU backend shares: the element type of float32 buffers, the
// alignment of every buffer and the ValueError helpers (fail, check_size).
//
// The backend is one translation unit: the pybind11 module src/ndarray_backend_cpu.cc includes the headers of
// src/cpu/, each once.  So their functions and globals are `static` (one copy, internal linkage), and each
// header includes every header it uses: any of them compiles on its own.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <sstream>
#include <string>

namespace needle {
namespace cpu {

namespace py = pybind11;

typedef float scalar_t;
constexpr size_t ELEM_SIZE = sizeof(scalar_t);
// Every buffer starts on a 64-byte boundary (one cache line).  Nothing relies on it for correctness:
// views carry offsets, so kernels always use unaligned loads/stores.
constexpr size_t ALIGNMENT = 64;

// Python's ValueError with this message: the error of every argument that does not fit (sizes, shapes, options).
[[noreturn]] static void fail(const std::string& msg) { throw py::value_error(msg); }

static void check_size(const char* fn, const char* what, size_t got, size_t expected) {
  if (got != expected) {
    std::ostringstream msg;
    msg << fn << ": " << what << " has " << got << " elements, expected " << expected;
    fail(msg.str());
  }
}

}  // namespace cpu
}  // namespace needle
