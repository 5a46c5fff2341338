// MSL shim: makes Metal Shading Language kernels compile as clang C++17 and run on the CPU harness.
// Included through the one-line <metal_stdlib> (and friends) in this directory; see docs/harness.md.
// Clang only: needs ext_vector_type, _Float16, __bf16 and address spaces.
#pragma once

// Every std header comes first: the address-space macros below (thread, device, ...) would break them.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "msl_rt_kernel.h"

#ifndef MSL_CPU
#define MSL_CPU 1
#endif
// The language version the file is compiled for (tools/msl2cpu.py --metal-version; tools/msl_rules.py has the
// default): what the shim declares follows it, so a kernel using a newer type fails here as on an older Mac.
#ifndef MSL_CPU_METAL_VERSION
#define MSL_CPU_METAL_VERSION 310
#endif
#define __METAL_VERSION__ MSL_CPU_METAL_VERSION
// Library maths: the C library on the CPU; the CUDA target (msl_cuda.h) routes these to libdevice.
#ifndef MSL_LIBM
#define MSL_LIBM(f) __builtin_##f
#endif

// ---- scalar and vector types (global, as in MSL) ----
typedef _Float16 half;
typedef __bf16 bfloat;  // MSL 3.1; below that tools/msl_rules.py rejects it (the shim itself uses it)
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef uint64_t ulong;

#define MSL_CPU_VECTORS(T)                             \
  typedef T T##2 __attribute__((ext_vector_type(2))); \
  typedef T T##3 __attribute__((ext_vector_type(3))); \
  typedef T T##4 __attribute__((ext_vector_type(4)));
MSL_CPU_VECTORS(float)
MSL_CPU_VECTORS(half)
MSL_CPU_VECTORS(bfloat)
MSL_CPU_VECTORS(int)
MSL_CPU_VECTORS(uint)
MSL_CPU_VECTORS(short)
MSL_CPU_VECTORS(ushort)
MSL_CPU_VECTORS(char)
MSL_CPU_VECTORS(uchar)
MSL_CPU_VECTORS(bool)
MSL_CPU_VECTORS(long)
MSL_CPU_VECTORS(ulong)
#undef MSL_CPU_VECTORS

namespace metal {

template <class T, int N>
using vec = T __attribute__((ext_vector_type(N)));

// ---- type traits over scalars and ext-vectors ----
template <class T>
struct vec_traits {
  static constexpr int size = 1;
  static constexpr bool is_vector = false;
  using elem = T;
};
template <class T, int N>
struct vec_traits<T __attribute__((ext_vector_type(N)))> {
  static constexpr int size = N;
  static constexpr bool is_vector = true;
  using elem = T;
};
template <class T>
using elem_t = typename vec_traits<T>::elem;
template <class T>
constexpr bool is_float_scalar_v =
    std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat>;
template <class T>
constexpr bool is_float_v = is_float_scalar_v<elem_t<T>>;  // scalar or vector of float/half/bfloat
template <class T>
constexpr bool is_arith_scalar_v = std::is_arithmetic_v<T> || is_float_scalar_v<T>;

using std::enable_if_t;
using std::is_same;
using std::is_same_v;
using std::conditional_t;
using std::is_floating_point_v;
using std::is_integral_v;

template <class T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static constexpr half max() { return half(65504.0f); }
  static constexpr half min() { return half(6.103515625e-05f); }
  static constexpr half lowest() { return half(-65504.0f); }
  static constexpr half epsilon() { return half(0.0009765625f); }
  static constexpr half infinity() { return half(__builtin_huge_valf()); }
  static constexpr half quiet_NaN() { return half(__builtin_nanf("")); }
};
template <>
struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static bfloat max() { return __builtin_bit_cast(bfloat, uint16_t(0x7F7F)); }
  static bfloat min() { return __builtin_bit_cast(bfloat, uint16_t(0x0080)); }
  static bfloat lowest() { return __builtin_bit_cast(bfloat, uint16_t(0xFF7F)); }
  static bfloat epsilon() { return __builtin_bit_cast(bfloat, uint16_t(0x3C00)); }
  static bfloat infinity() { return __builtin_bit_cast(bfloat, uint16_t(0x7F80)); }
  static bfloat quiet_NaN() { return __builtin_bit_cast(bfloat, uint16_t(0x7FC0)); }
};

// ---- MSL constructors: float4(x) splat, float4(v.xy, z, w) concatenation, float4(half4) conversion ----
// Element conversions are value conversions, never the ext-vector bitcast of a C-style cast.
template <class E, class A>
inline E convert(A a) {
  if constexpr (is_float_scalar_v<E> && is_float_scalar_v<A> && !std::is_same_v<E, A>) {
    return static_cast<E>(static_cast<float>(a));  // clang has no direct half <-> bfloat conversion
  } else {
    return static_cast<E>(a);
  }
}
template <class E, class A>
inline void ctor_put(E* buf, int& k, A a) {
  if constexpr (vec_traits<A>::is_vector) {
    for (int i = 0; i < vec_traits<A>::size; ++i) buf[k++] = convert<E>(elem_t<A>(a[i]));
  } else {
    buf[k++] = convert<E>(a);
  }
}
template <class V, class... A>
inline V msl_ctor(A... a) {
  using E = elem_t<V>;
  constexpr int N = vec_traits<V>::size;
  V r{};
  if constexpr (sizeof...(A) == 1 && (!vec_traits<A>::is_vector && ...)) {
    E v = convert<E>((a, ...));
    for (int i = 0; i < N; ++i) r[i] = v;
  } else if constexpr (sizeof...(A) > 0) {
    static_assert((vec_traits<A>::size + ...) == N, "MSL vector constructor: wrong number of components");
    E buf[N];
    int k = 0;
    (ctor_put<E>(buf, k, a), ...);
    for (int i = 0; i < N; ++i) r[i] = buf[i];
  }
  return r;
}

template <class To, class From>
inline To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  return __builtin_bit_cast(To, x);
}

// ---- math: float-like scalars compute in float and round once; vectors element-wise ----
#define MSL_CPU_UNARY(name, expr)                                                  \
  template <class T, enable_if_t<is_float_scalar_v<T>, int> = 0>                   \
  inline T name(T x_) {                                                            \
    float x = static_cast<float>(x_);                                              \
    return static_cast<T>(expr);                                                   \
  }                                                                                \
  template <class T, enable_if_t<vec_traits<T>::is_vector && is_float_v<T>, int> = 0> \
  inline T name(T x) {                                                             \
    T r;                                                                           \
    for (int i = 0; i < vec_traits<T>::size; ++i) r[i] = name(elem_t<T>(x[i]));    \
    return r;                                                                      \
  }
MSL_CPU_UNARY(sqrt, MSL_LIBM(sqrtf)(x))
MSL_CPU_UNARY(rsqrt, 1.0f / MSL_LIBM(sqrtf)(x))
MSL_CPU_UNARY(exp, MSL_LIBM(expf)(x))
MSL_CPU_UNARY(exp2, MSL_LIBM(exp2f)(x))
MSL_CPU_UNARY(exp10, MSL_LIBM(powf)(10.0f, x))
MSL_CPU_UNARY(log, MSL_LIBM(logf)(x))
MSL_CPU_UNARY(log2, MSL_LIBM(log2f)(x))
MSL_CPU_UNARY(log10, MSL_LIBM(log10f)(x))
MSL_CPU_UNARY(sin, MSL_LIBM(sinf)(x))
MSL_CPU_UNARY(cos, MSL_LIBM(cosf)(x))
MSL_CPU_UNARY(tan, MSL_LIBM(tanf)(x))
MSL_CPU_UNARY(tanh, MSL_LIBM(tanhf)(x))
MSL_CPU_UNARY(fabs, __builtin_fabsf(x))
MSL_CPU_UNARY(floor, __builtin_floorf(x))
MSL_CPU_UNARY(ceil, __builtin_ceilf(x))
MSL_CPU_UNARY(round, MSL_LIBM(roundf)(x))
MSL_CPU_UNARY(rint, __builtin_rintf(x))
MSL_CPU_UNARY(trunc, __builtin_truncf(x))
MSL_CPU_UNARY(fract, x - __builtin_floorf(x))
MSL_CPU_UNARY(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
MSL_CPU_UNARY(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x * 0.0f))
#undef MSL_CPU_UNARY

#define MSL_CPU_BINARY(name, expr)                                                 \
  template <class T, enable_if_t<is_float_scalar_v<T>, int> = 0>                   \
  inline T name(T x_, T y_) {                                                      \
    float x = static_cast<float>(x_), y = static_cast<float>(y_);                  \
    return static_cast<T>(expr);                                                   \
  }                                                                                \
  template <class T, enable_if_t<vec_traits<T>::is_vector && is_float_v<T>, int> = 0> \
  inline T name(T x, T y) {                                                        \
    T r;                                                                           \
    for (int i = 0; i < vec_traits<T>::size; ++i) r[i] = name(elem_t<T>(x[i]), elem_t<T>(y[i])); \
    return r;                                                                      \
  }
MSL_CPU_BINARY(pow, MSL_LIBM(powf)(x, y))
MSL_CPU_BINARY(powr, MSL_LIBM(powf)(x, y))
MSL_CPU_BINARY(fmin, __builtin_fminf(x, y))
MSL_CPU_BINARY(fmax, __builtin_fmaxf(x, y))
MSL_CPU_BINARY(fmod, MSL_LIBM(fmodf)(x, y))
MSL_CPU_BINARY(copysign, __builtin_copysignf(x, y))
MSL_CPU_BINARY(divide, x / y)
MSL_CPU_BINARY(atan2, MSL_LIBM(atan2f)(x, y))
#undef MSL_CPU_BINARY

template <class T, enable_if_t<is_float_scalar_v<T>, int> = 0>
inline T fma(T a, T b, T c) {
  return static_cast<T>(__builtin_fmaf(float(a), float(b), float(c)));
}
template <class T, enable_if_t<vec_traits<T>::is_vector && is_float_v<T>, int> = 0>
inline T fma(T a, T b, T c) {
  T r;
  for (int i = 0; i < vec_traits<T>::size; ++i) r[i] = fma(elem_t<T>(a[i]), elem_t<T>(b[i]), elem_t<T>(c[i]));
  return r;
}

// min/max/clamp/abs for every arithmetic scalar and vector; floats use fmin/fmax NaN rules.
template <class T>
inline T min(T a, T b) {
  if constexpr (vec_traits<T>::is_vector) {
    T r;
    for (int i = 0; i < vec_traits<T>::size; ++i) r[i] = min(elem_t<T>(a[i]), elem_t<T>(b[i]));
    return r;
  } else if constexpr (is_float_scalar_v<T>) {
    return fmin(a, b);
  } else {
    return b < a ? b : a;
  }
}
template <class T>
inline T max(T a, T b) {
  if constexpr (vec_traits<T>::is_vector) {
    T r;
    for (int i = 0; i < vec_traits<T>::size; ++i) r[i] = max(elem_t<T>(a[i]), elem_t<T>(b[i]));
    return r;
  } else if constexpr (is_float_scalar_v<T>) {
    return fmax(a, b);
  } else {
    return a < b ? b : a;
  }
}
template <class T>
inline T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
template <class T, enable_if_t<vec_traits<T>::is_vector, int> = 0>
inline T clamp(T x, elem_t<T> lo, elem_t<T> hi) {
  T r;
  for (int i = 0; i < vec_traits<T>::size; ++i) r[i] = clamp(elem_t<T>(x[i]), lo, hi);
  return r;
}
template <class T>
inline T abs(T x) {
  if constexpr (vec_traits<T>::is_vector) {
    T r;
    for (int i = 0; i < vec_traits<T>::size; ++i) r[i] = abs(elem_t<T>(x[i]));
    return r;
  } else if constexpr (is_float_scalar_v<T>) {
    return fabs(x);
  } else {
    return x < 0 ? T(-x) : x;
  }
}
template <class T>
inline T mix(T x, T y, T a) {
  return x + (y - x) * a;
}
template <class T>
inline T select(T a, T b, bool c) {
  return c ? b : a;
}
template <class T>
inline T step(T edge, T x) {
  return x < edge ? T(0) : T(1);
}
template <class T, enable_if_t<vec_traits<T>::is_vector, int> = 0>
inline elem_t<T> dot(T a, T b) {
  float s = 0.0f;  // float accumulation, one rounding at the end
  for (int i = 0; i < vec_traits<T>::size; ++i) s += float(a[i]) * float(b[i]);
  return static_cast<elem_t<T>>(s);
}
template <class T>
inline bool isnan(T x) {
  return __builtin_isnan(float(x));
}
template <class T>
inline bool isinf(T x) {
  return __builtin_isinf(float(x));
}
template <class T>
inline bool isfinite(T x) {
  return __builtin_isfinite(float(x));
}
template <class T>
inline bool signbit(T x) {
  return __builtin_signbit(float(x));
}
template <class T, enable_if_t<vec_traits<T>::is_vector, int> = 0>
inline bool all(T x) {
  for (int i = 0; i < vec_traits<T>::size; ++i)
    if (!x[i]) return false;
  return true;
}
template <class T, enable_if_t<vec_traits<T>::is_vector, int> = 0>
inline bool any(T x) {
  for (int i = 0; i < vec_traits<T>::size; ++i)
    if (x[i]) return true;
  return false;
}

// The CPU build is IEEE: fast:: and precise:: name the same functions (Metal's fast math is off in Lily).
namespace fast {
using metal::cos;
using metal::divide;
using metal::exp;
using metal::exp2;
using metal::fabs;
using metal::fmax;
using metal::fmin;
using metal::log;
using metal::log2;
using metal::max;
using metal::min;
using metal::pow;
using metal::powr;
using metal::rsqrt;
using metal::sin;
using metal::sqrt;
using metal::tanh;
}  // namespace fast
namespace precise {
using namespace metal::fast;
}

// ---- simdgroup_matrix<T, 8, 8>: two elements per lane, MLX lane layout (both targets) ----
template <class T, int Rows, int Cols>
struct simdgroup_matrix {
  static_assert(Rows == 8 && Cols == 8, "the shim supports 8x8 simdgroup matrices only");
  vec<T, 2> elements;
  vec<T, 2>& thread_elements() { return elements; }
  const vec<T, 2>& thread_elements() const { return elements; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

// ---- threadgroup and simdgroup synchronisation ----
enum class mem_flags : uint32_t { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint32_t(a) | uint32_t(b)); }

#if !defined(MSL_CUDA)
// `site` ("file:line", passed by the macros at the end of this header) tells barriers and collectives apart.
// The flags are required, as in Metal; tools/msl_rules.py rejects mem_none where threadgroup memory is used.
inline void threadgroup_barrier_at(const char* site, mem_flags flags) {
  ::msl_rt::threadgroup_barrier(site, (uint32_t(flags) & uint32_t(mem_flags::mem_threadgroup)) != 0);
}

namespace simd_detail {
inline void combine_nothing(void* const*, void* const*, uint32_t) {}
template <class T>
void combine_sum(void* const* in, void* const* out, uint32_t mask) {
  T acc = *static_cast<T*>(in[__builtin_ctz(mask)]);
  for (uint32_t m = mask & (mask - 1); m; m &= m - 1) acc = acc + *static_cast<T*>(in[__builtin_ctz(m)]);
  for (uint32_t m = mask; m; m &= m - 1) *static_cast<T*>(out[__builtin_ctz(m)]) = acc;
}
template <class T>
void combine_product(void* const* in, void* const* out, uint32_t mask) {
  T acc = *static_cast<T*>(in[__builtin_ctz(mask)]);
  for (uint32_t m = mask & (mask - 1); m; m &= m - 1) acc = acc * *static_cast<T*>(in[__builtin_ctz(m)]);
  for (uint32_t m = mask; m; m &= m - 1) *static_cast<T*>(out[__builtin_ctz(m)]) = acc;
}
template <class T, bool IsMax>
void combine_minmax(void* const* in, void* const* out, uint32_t mask) {
  T acc = *static_cast<T*>(in[__builtin_ctz(mask)]);
  for (uint32_t m = mask & (mask - 1); m; m &= m - 1) {
    T v = *static_cast<T*>(in[__builtin_ctz(m)]);
    acc = IsMax ? metal::max(acc, v) : metal::min(acc, v);
  }
  for (uint32_t m = mask; m; m &= m - 1) *static_cast<T*>(out[__builtin_ctz(m)]) = acc;
}
template <class T, int Op>  // 0 and, 1 or, 2 xor
void combine_bits(void* const* in, void* const* out, uint32_t mask) {
  T acc = *static_cast<T*>(in[__builtin_ctz(mask)]);
  for (uint32_t m = mask & (mask - 1); m; m &= m - 1) {
    T v = *static_cast<T*>(in[__builtin_ctz(m)]);
    acc = Op == 0 ? T(acc & v) : Op == 1 ? T(acc | v) : T(acc ^ v);
  }
  for (uint32_t m = mask; m; m &= m - 1) *static_cast<T*>(out[__builtin_ctz(m)]) = acc;
}
template <class T, bool Inclusive, bool Product>
void combine_prefix(void* const* in, void* const* out, uint32_t mask) {
  T acc = Product ? T(1) : T(0);
  for (uint32_t m = mask; m; m &= m - 1) {
    int l = __builtin_ctz(m);
    T v = *static_cast<T*>(in[l]);
    if (!Inclusive) *static_cast<T*>(out[l]) = acc;
    acc = Product ? T(acc * v) : T(acc + v);
    if (Inclusive) *static_cast<T*>(out[l]) = acc;
  }
}
// Shuffles: each lane posts its value and the lane it reads; reads of absent lanes keep the lane's own value.
template <class T>
struct ShuffleIn {
  T value;
  int source;
};
template <class T>
void combine_shuffle(void* const* in, void* const* out, uint32_t mask) {
  for (uint32_t m = mask; m; m &= m - 1) {
    int l = __builtin_ctz(m);
    auto* mine = static_cast<ShuffleIn<T>*>(in[l]);
    int s = mine->source;
    bool ok = s >= 0 && s < int(::msl_rt::kSimdWidth) && ((mask >> s) & 1u);
    *static_cast<T*>(out[l]) = ok ? static_cast<ShuffleIn<T>*>(in[s])->value : mine->value;
  }
}
template <class T>
void combine_broadcast_first(void* const* in, void* const* out, uint32_t mask) {
  T v = *static_cast<T*>(in[__builtin_ctz(mask)]);
  for (uint32_t m = mask; m; m &= m - 1) *static_cast<T*>(out[__builtin_ctz(m)]) = v;
}
inline void combine_ballot(void* const* in, void* const* out, uint32_t mask) {
  uint64_t bits = 0;
  for (uint32_t m = mask; m; m &= m - 1)
    if (*static_cast<bool*>(in[__builtin_ctz(m)])) bits |= uint64_t(1) << __builtin_ctz(m);
  for (uint32_t m = mask; m; m &= m - 1) *static_cast<uint64_t*>(out[__builtin_ctz(m)]) = bits;
}
inline void combine_is_first(void* const*, void* const* out, uint32_t mask) {
  for (uint32_t m = mask; m; m &= m - 1) *static_cast<bool*>(out[__builtin_ctz(m)]) = (m == mask);
}
inline void combine_active_mask(void* const*, void* const* out, uint32_t mask) {
  for (uint32_t m = mask; m; m &= m - 1) *static_cast<uint64_t*>(out[__builtin_ctz(m)]) = mask;
}
}  // namespace simd_detail

#define MSL_CPU_COLLECTIVE(combine, in, out, what) ::msl_rt::simd_collective(combine, in, out, site, what)

inline void simdgroup_barrier_at(const char* site, mem_flags) {
  MSL_CPU_COLLECTIVE(&simd_detail::combine_nothing, nullptr, nullptr, "simdgroup_barrier");
}
template <class T>
T simd_sum_at(const char* site, T x) {
  T r{};
  MSL_CPU_COLLECTIVE(&simd_detail::combine_sum<T>, &x, &r, "simd_sum");
  return r;
}
template <class T>
T simd_product_at(const char* site, T x) {
  T r{};
  MSL_CPU_COLLECTIVE(&simd_detail::combine_product<T>, &x, &r, "simd_product");
  return r;
}
template <class T>
T simd_max_at(const char* site, T x) {
  T r{};
  MSL_CPU_COLLECTIVE((&simd_detail::combine_minmax<T, true>), &x, &r, "simd_max");
  return r;
}
template <class T>
T simd_min_at(const char* site, T x) {
  T r{};
  MSL_CPU_COLLECTIVE((&simd_detail::combine_minmax<T, false>), &x, &r, "simd_min");
  return r;
}
template <class T>
T simd_and_at(const char* site, T x) {
  T r{};
  MSL_CPU_COLLECTIVE((&simd_detail::combine_bits<T, 0>), &x, &r, "simd_and");
  return r;
}
template <class T>
T simd_or_at(const char* site, T x) {
  T r{};
  MSL_CPU_COLLECTIVE((&simd_detail::combine_bits<T, 1>), &x, &r, "simd_or");
  return r;
}
template <class T>
T simd_xor_at(const char* site, T x) {
  T r{};
  MSL_CPU_COLLECTIVE((&simd_detail::combine_bits<T, 2>), &x, &r, "simd_xor");
  return r;
}
template <class T>
T simd_prefix_inclusive_sum_at(const char* site, T x) {
  T r{};
  MSL_CPU_COLLECTIVE((&simd_detail::combine_prefix<T, true, false>), &x, &r, "simd_prefix_inclusive_sum");
  return r;
}
template <class T>
T simd_prefix_exclusive_sum_at(const char* site, T x) {
  T r{};
  MSL_CPU_COLLECTIVE((&simd_detail::combine_prefix<T, false, false>), &x, &r, "simd_prefix_exclusive_sum");
  return r;
}
template <class T>
T simd_prefix_inclusive_product_at(const char* site, T x) {
  T r{};
  MSL_CPU_COLLECTIVE((&simd_detail::combine_prefix<T, true, true>), &x, &r, "simd_prefix_inclusive_product");
  return r;
}
template <class T>
T simd_prefix_exclusive_product_at(const char* site, T x) {
  T r{};
  MSL_CPU_COLLECTIVE((&simd_detail::combine_prefix<T, false, true>), &x, &r, "simd_prefix_exclusive_product");
  return r;
}
template <class T>
T simd_shuffle_at(const char* site, T x, ushort lane) {
  simd_detail::ShuffleIn<T> in{x, int(lane)};
  T r{};
  MSL_CPU_COLLECTIVE(&simd_detail::combine_shuffle<T>, &in, &r, "simd_shuffle");
  return r;
}
template <class T>
T simd_broadcast_at(const char* site, T x, ushort lane) {
  simd_detail::ShuffleIn<T> in{x, int(lane)};
  T r{};
  MSL_CPU_COLLECTIVE(&simd_detail::combine_shuffle<T>, &in, &r, "simd_broadcast");
  return r;
}
template <class T>
T simd_shuffle_xor_at(const char* site, T x, ushort mask) {
  simd_detail::ShuffleIn<T> in{x, int(::msl_rt::current_lane() ^ mask)};
  T r{};
  MSL_CPU_COLLECTIVE(&simd_detail::combine_shuffle<T>, &in, &r, "simd_shuffle_xor");
  return r;
}
template <class T>
T simd_shuffle_down_at(const char* site, T x, ushort delta) {
  simd_detail::ShuffleIn<T> in{x, int(::msl_rt::current_lane() + delta)};
  T r{};
  MSL_CPU_COLLECTIVE(&simd_detail::combine_shuffle<T>, &in, &r, "simd_shuffle_down");
  return r;
}
template <class T>
T simd_shuffle_up_at(const char* site, T x, ushort delta) {
  simd_detail::ShuffleIn<T> in{x, int(::msl_rt::current_lane()) - int(delta)};
  T r{};
  MSL_CPU_COLLECTIVE(&simd_detail::combine_shuffle<T>, &in, &r, "simd_shuffle_up");
  return r;
}
template <class T>
T simd_broadcast_first_at(const char* site, T x) {
  T r{};
  MSL_CPU_COLLECTIVE(&simd_detail::combine_broadcast_first<T>, &x, &r, "simd_broadcast_first");
  return r;
}

struct simd_vote {
  using vote_t = uint64_t;
  vote_t bits;
  explicit constexpr simd_vote(vote_t v = 0) : bits(v) {}
  explicit constexpr operator vote_t() const { return bits; }
  bool all() const;
  bool any() const { return bits != 0; }
};
inline simd_vote simd_ballot_at(const char* site, bool pred) {
  uint64_t r = 0;
  MSL_CPU_COLLECTIVE(&simd_detail::combine_ballot, &pred, &r, "simd_ballot");
  return simd_vote(r);
}
inline simd_vote simd_active_threads_mask_at(const char* site) {
  uint64_t r = 0;
  MSL_CPU_COLLECTIVE(&simd_detail::combine_active_mask, nullptr, &r, "simd_active_threads_mask");
  return simd_vote(r);
}
// all(): every lane of the simdgroup voted (the active mask of the vote's simdgroup is not recorded).
inline bool simd_vote::all() const { return bits == 0xFFFFFFFFull; }
inline bool simd_all_at(const char* site, bool pred) {
  uint64_t votes = 0, active = 0;
  MSL_CPU_COLLECTIVE(&simd_detail::combine_ballot, &pred, &votes, "simd_all");
  MSL_CPU_COLLECTIVE(&simd_detail::combine_active_mask, nullptr, &active, "simd_all");
  return votes == active;
}
inline bool simd_any_at(const char* site, bool pred) {
  uint64_t votes = 0;
  MSL_CPU_COLLECTIVE(&simd_detail::combine_ballot, &pred, &votes, "simd_any");
  return votes != 0;
}
inline bool simd_is_first_at(const char* site) {
  bool r = false;
  MSL_CPU_COLLECTIVE(&simd_detail::combine_is_first, nullptr, &r, "simd_is_first");
  return r;
}

// ---- atomics: free functions (member calls on address-space objects do not compile) ----
enum memory_order { memory_order_relaxed };  // the only order Metal's atomic functions take
template <class T>
struct _atomic {
  T value;
};
template <class T>
using atomic = _atomic<T>;
typedef _atomic<int> atomic_int;
typedef _atomic<uint> atomic_uint;
#if __METAL_VERSION__ >= 300
typedef _atomic<float> atomic_float;
#endif
typedef _atomic<bool> atomic_bool;

namespace atomic_detail {
template <class T>
inline T* generic(volatile T __attribute__((address_space(1)))* p) {
  return (T*)p;
}
template <class T>
inline T* generic(volatile T __attribute__((address_space(3)))* p) {
  return (T*)p;
}
template <class T, class F>
inline T rmw(T* p, F f) {  // compare-exchange loop: works for float as well as integers
  T old;
  __atomic_load(p, &old, __ATOMIC_SEQ_CST);
  T desired = f(old);
  while (!__atomic_compare_exchange(p, &old, &desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) desired = f(old);
  ::msl_rt::note_progress();
  return old;
}
}  // namespace atomic_detail

#define MSL_CPU_ATOMIC_AS(AS)                                                                        \
  template <class T>                                                                                 \
  inline T atomic_load_explicit(volatile AS _atomic<T>* o, memory_order = memory_order_relaxed) {    \
    ::msl_rt::yield_for_atomic();                                                                    \
    T r;                                                                                             \
    __atomic_load(atomic_detail::generic(&o->value), &r, __ATOMIC_SEQ_CST);                          \
    return r;                                                                                        \
  }                                                                                                  \
  template <class T, class U>                                                                        \
  inline void atomic_store_explicit(volatile AS _atomic<T>* o, U v, memory_order = memory_order_relaxed) { \
    T t = static_cast<T>(v);                                                                         \
    __atomic_store(atomic_detail::generic(&o->value), &t, __ATOMIC_SEQ_CST);                         \
    ::msl_rt::note_progress();                                                                       \
  }                                                                                                  \
  template <class T, class U>                                                                        \
  inline T atomic_exchange_explicit(volatile AS _atomic<T>* o, U v, memory_order = memory_order_relaxed) { \
    return atomic_detail::rmw(atomic_detail::generic(&o->value), [&](T) { return static_cast<T>(v); }); \
  }                                                                                                  \
  template <class T, class U>                                                                        \
  inline T atomic_fetch_add_explicit(volatile AS _atomic<T>* o, U v, memory_order = memory_order_relaxed) { \
    return atomic_detail::rmw(atomic_detail::generic(&o->value), [&](T a) { return T(a + static_cast<T>(v)); }); \
  }                                                                                                  \
  template <class T, class U>                                                                        \
  inline T atomic_fetch_sub_explicit(volatile AS _atomic<T>* o, U v, memory_order = memory_order_relaxed) { \
    return atomic_detail::rmw(atomic_detail::generic(&o->value), [&](T a) { return T(a - static_cast<T>(v)); }); \
  }                                                                                                  \
  template <class T, class U>                                                                        \
  inline T atomic_fetch_min_explicit(volatile AS _atomic<T>* o, U v, memory_order = memory_order_relaxed) { \
    return atomic_detail::rmw(atomic_detail::generic(&o->value), [&](T a) { return metal::min(a, static_cast<T>(v)); }); \
  }                                                                                                  \
  template <class T, class U>                                                                        \
  inline T atomic_fetch_max_explicit(volatile AS _atomic<T>* o, U v, memory_order = memory_order_relaxed) { \
    return atomic_detail::rmw(atomic_detail::generic(&o->value), [&](T a) { return metal::max(a, static_cast<T>(v)); }); \
  }                                                                                                  \
  template <class T, class U>                                                                        \
  inline T atomic_fetch_and_explicit(volatile AS _atomic<T>* o, U v, memory_order = memory_order_relaxed) { \
    return atomic_detail::rmw(atomic_detail::generic(&o->value), [&](T a) { return T(a & static_cast<T>(v)); }); \
  }                                                                                                  \
  template <class T, class U>                                                                        \
  inline T atomic_fetch_or_explicit(volatile AS _atomic<T>* o, U v, memory_order = memory_order_relaxed) { \
    return atomic_detail::rmw(atomic_detail::generic(&o->value), [&](T a) { return T(a | static_cast<T>(v)); }); \
  }                                                                                                  \
  template <class T, class U>                                                                        \
  inline T atomic_fetch_xor_explicit(volatile AS _atomic<T>* o, U v, memory_order = memory_order_relaxed) { \
    return atomic_detail::rmw(atomic_detail::generic(&o->value), [&](T a) { return T(a ^ static_cast<T>(v)); }); \
  }                                                                                                  \
  template <class T, class U>                                                                        \
  inline bool atomic_compare_exchange_weak_explicit(volatile AS _atomic<T>* o, T* expected, U desired, \
                                                    memory_order = memory_order_relaxed,             \
                                                    memory_order = memory_order_relaxed) {           \
    T d = static_cast<T>(desired);                                                                   \
    bool ok = __atomic_compare_exchange(atomic_detail::generic(&o->value), expected, &d, false,      \
                                        __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                         \
    if (ok) ::msl_rt::note_progress();                                                               \
    else ::msl_rt::yield_for_atomic();                                                               \
    return ok;                                                                                       \
  }
MSL_CPU_ATOMIC_AS(__attribute__((address_space(1))))
MSL_CPU_ATOMIC_AS(__attribute__((address_space(3))))
#undef MSL_CPU_ATOMIC_AS

// ---- simdgroup_matrix<T, 8, 8> operations on the CPU harness's lanes ----
namespace matrix_detail {
// Row and first column of the two elements lane `lane` holds: (row, col) and (row, col + 1).
inline void lane_coord(uint32_t lane, int& row, int& col) {
  uint32_t qid = lane / 4;
  row = int((qid & 4) + ((lane / 2) % 4));
  col = int((qid & 2) * 2 + (lane % 2) * 2);
}
template <class TD, class TA, class TB, class TC>
struct MmaIn {
  const simdgroup_matrix<TA, 8, 8>* a;
  const simdgroup_matrix<TB, 8, 8>* b;
  const simdgroup_matrix<TC, 8, 8>* c;  // null: plain multiply
};
// Gathers all 32 lanes' fragments, computes D = A*B (+C) in fp32 and rounds once per element.
template <class TD, class TA, class TB, class TC>
void combine_mma(void* const* in, void* const* out, uint32_t mask) {
  if (mask != 0xFFFFFFFFu) ::msl_rt::kernel_fault("simdgroup_multiply(_accumulate) needs all 32 lanes of the simdgroup");
  float A[8][8], B[8][8], C[8][8];
  for (uint32_t l = 0; l < 32; ++l) {
    auto* p = static_cast<MmaIn<TD, TA, TB, TC>*>(in[l]);
    int r, c;
    lane_coord(l, r, c);
    for (int e = 0; e < 2; ++e) {
      A[r][c + e] = float(p->a->elements[e]);
      B[r][c + e] = float(p->b->elements[e]);
      C[r][c + e] = p->c ? float(p->c->elements[e]) : 0.0f;
    }
  }
  for (uint32_t l = 0; l < 32; ++l) {
    int r, c;
    lane_coord(l, r, c);
    auto* d = static_cast<simdgroup_matrix<TD, 8, 8>*>(out[l]);
    for (int e = 0; e < 2; ++e) {
      float s = C[r][c + e];
      for (int k = 0; k < 8; ++k) s += A[r][k] * B[k][c + e];
      d->elements[e] = static_cast<TD>(s);
    }
  }
}
}  // namespace matrix_detail

template <class T, int R, int C>
inline simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, R, C> m;
  m.elements = vec<T, 2>{value, value};
  return m;
}

// Metal declares simdgroup_load/store over one element type T (clang would convert), and simdgroup_multiply(_accumulate)
// over one type, or half/bfloat operands accumulated into float matrices (llama.cpp's Metal GEMMs, kernel_mul_mm,
// compile that way: simdgroup_half8x8 and simdgroup_bfloat8x8 operands, simdgroup_float8x8 accumulators).
#define MSL_CPU_SIMDGROUP_TYPES_RULE \
  "[simdgroup-element-types] simdgroup_load/store take matrices and memory of one element type, " \
  "simdgroup_multiply(_accumulate) operands of one type accumulated into the same type or float: convert explicitly"
template <class TD, class TA, class TB, class TC>
constexpr bool simdgroup_mma_types_ok =
    std::is_same<TA, TB>::value && std::is_same<TD, TC>::value &&
    (std::is_same<TD, TA>::value || std::is_same<TD, float>::value);
// matrix_origin is (x = column, y = row) of the stored matrix; transpose loads its transpose.
// (Both conventions are assumptions until checked on a Mac; see docs/harness.md.)
#define MSL_CPU_MATRIX_AS(AS)                                                                         \
  template <class T, class S>                                                                         \
  inline void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const AS S* src, ulong elements_per_row = 8, \
                             ulong2 matrix_origin = ulong2{0, 0}, bool transpose = false) {           \
    static_assert(std::is_same<T, S>::value, MSL_CPU_SIMDGROUP_TYPES_RULE);                           \
    int r, c;                                                                                         \
    matrix_detail::lane_coord(::msl_rt::current_lane(), r, c);                                        \
    for (int e = 0; e < 2; ++e) {                                                                     \
      ulong row = transpose ? ulong(c + e) : ulong(r), col = transpose ? ulong(r) : ulong(c + e);     \
      d.elements[e] = static_cast<T>(src[(matrix_origin.y + row) * elements_per_row + matrix_origin.x + col]); \
    }                                                                                                 \
  }                                                                                                   \
  template <class T, class S>                                                                         \
  inline void simdgroup_store(simdgroup_matrix<T, 8, 8> m, AS S* dst, ulong elements_per_row = 8,     \
                              ulong2 matrix_origin = ulong2{0, 0}, bool transpose = false) {          \
    static_assert(std::is_same<T, S>::value, MSL_CPU_SIMDGROUP_TYPES_RULE);                           \
    int r, c;                                                                                         \
    matrix_detail::lane_coord(::msl_rt::current_lane(), r, c);                                        \
    for (int e = 0; e < 2; ++e) {                                                                     \
      ulong row = transpose ? ulong(c + e) : ulong(r), col = transpose ? ulong(r) : ulong(c + e);     \
      dst[(matrix_origin.y + row) * elements_per_row + matrix_origin.x + col] = static_cast<S>(m.elements[e]); \
    }                                                                                                 \
  }
MSL_CPU_MATRIX_AS(__attribute__((address_space(1))))
MSL_CPU_MATRIX_AS(__attribute__((address_space(3))))
#undef MSL_CPU_MATRIX_AS

template <class TD, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate_at(const char* site, simdgroup_matrix<TD, 8, 8>& d,
                                                             const simdgroup_matrix<TA, 8, 8>& a,
                                                             const simdgroup_matrix<TB, 8, 8>& b,
                                                             const simdgroup_matrix<TC, 8, 8>& c) {
  static_assert(simdgroup_mma_types_ok<TD, TA, TB, TC>, MSL_CPU_SIMDGROUP_TYPES_RULE);
  matrix_detail::MmaIn<TD, TA, TB, TC> in{&a, &b, &c};
  MSL_CPU_COLLECTIVE((&matrix_detail::combine_mma<TD, TA, TB, TC>), &in, &d, "simdgroup_multiply_accumulate");
}
template <class TD, class TA, class TB>
inline void simdgroup_multiply_at(const char* site, simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                                  const simdgroup_matrix<TB, 8, 8>& b) {
  static_assert(simdgroup_mma_types_ok<TD, TA, TB, TD>, MSL_CPU_SIMDGROUP_TYPES_RULE);
  matrix_detail::MmaIn<TD, TA, TB, TD> in{&a, &b, nullptr};
  MSL_CPU_COLLECTIVE((&matrix_detail::combine_mma<TD, TA, TB, TD>), &in, &d, "simdgroup_multiply");
}
#undef MSL_CPU_COLLECTIVE
#else
#include "msl_cuda_sync.h"  // the same functions on an NVIDIA warp
#endif  // MSL_CUDA

}  // namespace metal

// Types are also visible unqualified, as in MSL.
using metal::vec;

#if !defined(MSL_CUDA)
// ---- argument binding: builds each kernel parameter from its attribute (used by the generated code) ----
namespace msl_cpu_detail {
template <class P>
inline P position_arg(const uint32_t (&v)[3]) {
  if constexpr (metal::vec_traits<P>::is_vector) {
    P r{};
    for (int i = 0; i < metal::vec_traits<P>::size && i < 3; ++i) r[i] = static_cast<metal::elem_t<P>>(v[i]);
    return r;
  } else {
    return static_cast<P>(v[0]);
  }
}
template <class P>
inline P make_arg(const ::msl_rt::ParamAttr& a, const ::msl_rt::LaunchArgs& L) {
  using ::msl_rt::Attr;
  if constexpr (std::is_pointer_v<P>) {
    void* p = a.kind == Attr::threadgroup_memory ? L.tg_memory[a.index] : L.buffers[a.index];
    return __builtin_bit_cast(P, p);
  } else if constexpr (std::is_reference_v<P>) {
    using R = std::remove_reference_t<P>;
    return *__builtin_bit_cast(R*, L.buffers[a.index]);
  } else {
    switch (a.kind) {
      case Attr::thread_position_in_grid: return position_arg<P>(L.thread_in_grid);
      case Attr::thread_position_in_threadgroup: return position_arg<P>(L.thread_in_tg);
      case Attr::threadgroup_position_in_grid: return position_arg<P>(L.tg_in_grid);
      case Attr::threads_per_threadgroup: return position_arg<P>(L.threads_per_tg);
      case Attr::threadgroups_per_grid: return position_arg<P>(L.tgs_per_grid);
      case Attr::threads_per_grid: return position_arg<P>(L.threads_per_grid);
      case Attr::thread_index_in_threadgroup: return static_cast<P>(L.index_in_tg);
      case Attr::thread_index_in_simdgroup: return static_cast<P>(L.lane);
      case Attr::simdgroup_index_in_threadgroup: return static_cast<P>(L.simdgroup);
      case Attr::threads_per_simdgroup:
      case Attr::thread_execution_width: return static_cast<P>(::msl_rt::kSimdWidth);
      case Attr::simdgroups_per_threadgroup: return static_cast<P>(L.simdgroups_per_tg);
      default: ::msl_rt::kernel_fault("a by-value kernel parameter has a [[buffer]]/[[threadgroup]] attribute");
    }
  }
}
template <class P>
inline ::msl_rt::ParamInfo param_info() {
  if constexpr (std::is_pointer_v<P>) {
    using E = std::remove_pointer_t<P>;
    if constexpr (std::is_void_v<std::remove_cv_t<E>>) return {::msl_rt::ParamKind::pointer, 1};
    else return {::msl_rt::ParamKind::pointer, sizeof(E)};
  } else if constexpr (std::is_reference_v<P>) {
    return {::msl_rt::ParamKind::reference, sizeof(std::remove_reference_t<P>)};
  } else {
    return {::msl_rt::ParamKind::value, sizeof(P)};
  }
}
template <class... P, size_t... I>
inline void call(void (*f)(P...), const ::msl_rt::ParamAttr* attrs, const ::msl_rt::LaunchArgs& L,
                 std::index_sequence<I...>) {
  f(make_arg<P>(attrs[I], L)...);
}
template <class... P>
constexpr size_t arity(void (*)(P...)) {
  return sizeof...(P);
}
template <auto F>
void launch_kernel(const ::msl_rt::ParamAttr* attrs, const ::msl_rt::LaunchArgs& L) {
  call(F, attrs, L, std::make_index_sequence<arity(F)>{});
}
#ifndef MSL_CPU_NO_ADDRSPACES
template <class T>
inline __attribute__((address_space(3))) T* threadgroup_array(const char* key) {
  return __builtin_bit_cast(__attribute__((address_space(3))) T*, ::msl_rt::threadgroup_alloc(key, sizeof(T)));
}
#else
template <class T>
inline T* threadgroup_array(const char* key) {
  return static_cast<T*>(::msl_rt::threadgroup_alloc(key, sizeof(T)));
}
#endif
template <class... P>
std::vector<::msl_rt::ParamInfo> param_infos(void (*)(P...)) {
  return {param_info<P>()...};
}
template <class... P>
constexpr int param_count(void (*)(P...)) {
  return int(sizeof...(P));
}
}  // namespace msl_cpu_detail

#define MSL_CPU_CAT2(a, b) a##b
#define MSL_CPU_CAT(a, b) MSL_CPU_CAT2(a, b)
// Registers `fn<targs...>` under host_name; the generated code provides msl_param_attrs_<fn>,
// msl_variant_fcs / msl_variant_fc_count and msl_registry_id in the enclosing namespace.
#define MSL_CPU_INSTANTIATE(host_name, fn, ...)                                                          \
  static_assert(::msl_cpu_detail::param_count(&fn<__VA_ARGS__>) ==                                      \
                    int(sizeof(msl_param_attrs_##fn) / sizeof(msl_param_attrs_##fn[0])),                \
                "kernel parameter count and attribute table disagree");                                 \
  static ::msl_rt::KernelRegistrar MSL_CPU_CAT(msl_registrar_, __LINE__)(                              \
      host_name, msl_registry_id, &::msl_cpu_detail::launch_kernel<&fn<__VA_ARGS__>>, msl_param_attrs_##fn, \
      int(sizeof(msl_param_attrs_##fn) / sizeof(msl_param_attrs_##fn[0])),                             \
      ::msl_cpu_detail::param_infos(&fn<__VA_ARGS__>), msl_variant_fcs, msl_variant_fc_count, msl_source_file);
// The harness has no programmatic dependent launch: a kernel that waits itself is instantiated as any other.
#define MSL_CPU_INSTANTIATE_EARLY(host_name, fn, ...) MSL_CPU_INSTANTIATE(host_name, fn, __VA_ARGS__)
#define MSL_CPU_INSTANTIATE_PLAIN(host_name, fn)                                                         \
  static ::msl_rt::KernelRegistrar MSL_CPU_CAT(msl_registrar_, __LINE__)(                              \
      host_name, msl_registry_id, &::msl_cpu_detail::launch_kernel<&fn>, msl_param_attrs_##fn,         \
      int(sizeof(msl_param_attrs_##fn) / sizeof(msl_param_attrs_##fn[0])), ::msl_cpu_detail::param_infos(&fn), \
      msl_variant_fcs, msl_variant_fc_count, msl_source_file);

#else
#include "msl_cuda_launch.h"  // __global__ entry points instead of registrations
#endif  // MSL_CUDA

// ---- address spaces (after every std header: `thread` would break std::thread) ----
#if defined(MSL_CUDA)
#define device __attribute__((address_space(1)))
#define constant const  // generic: a constant T& argument points into a global buffer
#define threadgroup __attribute__((address_space(3)))
#elif !defined(MSL_CPU_NO_ADDRSPACES)
#define device __attribute__((address_space(1)))
#define constant const __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#else
#define device
#define constant const
#define threadgroup
#endif
#define thread
#define METAL_FUNC inline

// ---- MSL constructors as function-like macros: `float4 v;` still names the type ----
#define float2(...) ::metal::msl_ctor<::float2>(__VA_ARGS__)
#define float3(...) ::metal::msl_ctor<::float3>(__VA_ARGS__)
#define float4(...) ::metal::msl_ctor<::float4>(__VA_ARGS__)
#define half2(...) ::metal::msl_ctor<::half2>(__VA_ARGS__)
#define half3(...) ::metal::msl_ctor<::half3>(__VA_ARGS__)
#define half4(...) ::metal::msl_ctor<::half4>(__VA_ARGS__)
#define bfloat2(...) ::metal::msl_ctor<::bfloat2>(__VA_ARGS__)
#define bfloat3(...) ::metal::msl_ctor<::bfloat3>(__VA_ARGS__)
#define bfloat4(...) ::metal::msl_ctor<::bfloat4>(__VA_ARGS__)
#define int2(...) ::metal::msl_ctor<::int2>(__VA_ARGS__)
#define int3(...) ::metal::msl_ctor<::int3>(__VA_ARGS__)
#define int4(...) ::metal::msl_ctor<::int4>(__VA_ARGS__)
#define uint2(...) ::metal::msl_ctor<::uint2>(__VA_ARGS__)
#define uint3(...) ::metal::msl_ctor<::uint3>(__VA_ARGS__)
#define uint4(...) ::metal::msl_ctor<::uint4>(__VA_ARGS__)
#define short2(...) ::metal::msl_ctor<::short2>(__VA_ARGS__)
#define short3(...) ::metal::msl_ctor<::short3>(__VA_ARGS__)
#define short4(...) ::metal::msl_ctor<::short4>(__VA_ARGS__)
#define ushort2(...) ::metal::msl_ctor<::ushort2>(__VA_ARGS__)
#define ushort3(...) ::metal::msl_ctor<::ushort3>(__VA_ARGS__)
#define ushort4(...) ::metal::msl_ctor<::ushort4>(__VA_ARGS__)
#define char2(...) ::metal::msl_ctor<::char2>(__VA_ARGS__)
#define char3(...) ::metal::msl_ctor<::char3>(__VA_ARGS__)
#define char4(...) ::metal::msl_ctor<::char4>(__VA_ARGS__)
#define uchar2(...) ::metal::msl_ctor<::uchar2>(__VA_ARGS__)
#define uchar3(...) ::metal::msl_ctor<::uchar3>(__VA_ARGS__)
#define uchar4(...) ::metal::msl_ctor<::uchar4>(__VA_ARGS__)
#define long2(...) ::metal::msl_ctor<::long2>(__VA_ARGS__)
#define long3(...) ::metal::msl_ctor<::long3>(__VA_ARGS__)
#define long4(...) ::metal::msl_ctor<::long4>(__VA_ARGS__)
#define ulong2(...) ::metal::msl_ctor<::ulong2>(__VA_ARGS__)
#define ulong3(...) ::metal::msl_ctor<::ulong3>(__VA_ARGS__)
#define ulong4(...) ::metal::msl_ctor<::ulong4>(__VA_ARGS__)
#define bool2(...) ::metal::msl_ctor<::bool2>(__VA_ARGS__)
#define bool3(...) ::metal::msl_ctor<::bool3>(__VA_ARGS__)
#define bool4(...) ::metal::msl_ctor<::bool4>(__VA_ARGS__)

// ---- barriers and collectives record their source line: lanes at different lines are divergent ----
// (Function-like macros, so `metal::simd_sum(x)` and `simd_sum(x)` both work; a plain call site could be
// merged by the optimiser, e.g. one barrier hoisted out of both branches of an if.)
#define MSL_CPU_STR2(x) #x
#define MSL_CPU_STR(x) MSL_CPU_STR2(x)
#define MSL_CPU_SITE __FILE__ ":" MSL_CPU_STR(__LINE__)
#define threadgroup_barrier(...) threadgroup_barrier_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simdgroup_barrier(...) simdgroup_barrier_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_sum(...) simd_sum_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_product(...) simd_product_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_max(...) simd_max_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_min(...) simd_min_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_and(...) simd_and_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_or(...) simd_or_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_xor(...) simd_xor_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_prefix_inclusive_sum(...) simd_prefix_inclusive_sum_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_prefix_exclusive_sum(...) simd_prefix_exclusive_sum_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_prefix_inclusive_product(...) simd_prefix_inclusive_product_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_prefix_exclusive_product(...) simd_prefix_exclusive_product_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_shuffle(...) simd_shuffle_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_broadcast(...) simd_broadcast_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_shuffle_xor(...) simd_shuffle_xor_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_shuffle_down(...) simd_shuffle_down_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_shuffle_up(...) simd_shuffle_up_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_broadcast_first(...) simd_broadcast_first_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_ballot(...) simd_ballot_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_active_threads_mask(...) simd_active_threads_mask_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_all(...) simd_all_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_any(...) simd_any_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simd_is_first(...) simd_is_first_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simdgroup_multiply_accumulate(...) simdgroup_multiply_accumulate_at(MSL_CPU_SITE, ##__VA_ARGS__)
#define simdgroup_multiply(...) simdgroup_multiply_at(MSL_CPU_SITE, ##__VA_ARGS__)

#define MAXFLOAT 3.402823466e+38f
#define INFINITY __builtin_huge_valf()
#define NAN __builtin_nanf("")
#define HUGE_VALF __builtin_huge_valf()
#define M_PI_F 3.14159265358979323846f
#define M_LN2_F 0.69314718055994530942f
#define M_LOG2E_F 1.44269504088896340736f
#define M_SQRT2_F 1.41421356237309504880f
