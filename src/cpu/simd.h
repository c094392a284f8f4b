// simd.h -- GCC vector types (4, 8 or 16 floats; 4 or 8 doubles) and the instruction sets this build can
// target: NEEDLE_X86_DISPATCH (AVX2 and AVX-512 versions of the vector math and matmul kernels, compiled with
// per-function `target` attributes and chosen at run time, so the module needs no -march flag),
// NEEDLE_BF16_DOT (the bfloat16 dot-product matmul kernel, matmul_bf16.h), and cpu_has, which asks the CPU.
#pragma once

#include "common.h"

#include <cstring>

// The bfloat16 dot-product matmul kernel (matmul_bf16.h) is written with intrinsics, which need a compiler
// that knows AVX512-BF16 (GCC 10, clang 9); everything else uses GCC vector extensions.
#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 9 : (defined(__GNUC__) && __GNUC__ >= 10))
#define NEEDLE_HAVE_IMMINTRIN 1
#include <immintrin.h>
#endif

namespace needle {
namespace cpu {

typedef scalar_t v4sf __attribute__((vector_size(16)));
typedef double v4df __attribute__((vector_size(32)));
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define NEEDLE_X86_DISPATCH 1
typedef scalar_t v8sf __attribute__((vector_size(32)));
typedef scalar_t v16sf __attribute__((vector_size(64)));
typedef double v8df __attribute__((vector_size(64)));
#ifdef NEEDLE_HAVE_IMMINTRIN
#define NEEDLE_BF16_DOT 1  // the bfloat16 dot-product matmul kernel (matmul_bf16.h)
#endif
#endif

// Whether this CPU (and OS) runs code for the instruction set `name`: avx512, avx2 or generic.
static bool cpu_has(const char* name) {
#ifdef NEEDLE_X86_DISPATCH
  __builtin_cpu_init();
  if (std::strcmp(name, "avx512") == 0) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  if (std::strcmp(name, "avx2") == 0) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return std::strcmp(name, "generic") == 0;
}

}  // namespace cpu
}  // namespace needle
