// What the CPU kernels' AVX2 paths share (qmatmul.cpp, gated_delta.cpp): LILY_CPU_X86 where the compiler can target
// AVX2 per function, and the horizontal sum of 8 floats.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LILY_CPU_X86 1

namespace lily::cpu {

// v[0] + ... + v[7], in one fixed order.
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace lily::cpu
#endif
