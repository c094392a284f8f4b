// common.h -- what every part of the C++ CPU backend shares: the element type of float32 buffers, the
// alignment of every buffer and the ValueError helpers (fail, check_size, checked_product, check_extents).
//
// The backend is one translation unit: the pybind11 module src/ndarray_backend_cpu.cc includes the headers of
// src/cpu/, each once.  So their functions and globals are `static` (one copy, internal linkage), and each
// header includes every header it uses: any of them compiles on its own.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <initializer_list>
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

// The element count of an array of these extents (m, n, p, rows, batch: each >= 0, which the caller has checked),
// or ValueError when it overflows 64 bits.  A product that wrapped around could equal a small buffer's size, and a
// kernel would then read far past it: the sizes a function is handed are checked as make_walk checks a view's.
template <class... Extents>
static size_t checked_product(const char* fn, const char* what, Extents... extents) {
  size_t product = 1;
  bool overflow = false, zero = false;
  for (size_t extent : {static_cast<size_t>(extents)...}) {
    zero |= extent == 0;
    overflow |= __builtin_mul_overflow(product, extent, &product);
  }
  if (zero) return 0;  // exactly, even when the extents before the zero overflowed
  if (overflow) {
    std::ostringstream msg;
    msg << fn << ": " << what << " would have ";
    const char* sep = "";
    ((msg << sep << extents, sep = " * "), ...);
    msg << " elements, more than a 64-bit size can count";
    fail(msg.str());
  }
  return product;
}

// check_size against the product of the extents, overflow-checked.
template <class... Extents>
static void check_extents(const char* fn, const char* what, size_t got, Extents... extents) {
  check_size(fn, what, got, checked_product(fn, what, extents...));
}

}  // namespace cpu
}  // namespace needle
