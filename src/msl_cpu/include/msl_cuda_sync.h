// CUDA target of the MSL shim: barriers, SIMD collectives, atomics and simdgroup_matrix on an NVIDIA warp.
// Included by msl_cpu.h inside namespace metal in place of the CPU harness's versions, with the same names and the
// same rules where Metal defines them: a simdgroup is 32 consecutive threads of the threadgroup (a warp); collectives
// combine the lanes active at the call; a shuffle from an inactive or out-of-range lane returns the lane's own value.
// The `site` argument (used by the CPU harness to detect divergence) is ignored.

namespace cuda_detail {
inline uint32_t lane() { return uint32_t(__nvvm_read_ptx_sreg_laneid()); }
inline uint32_t active() { return uint32_t(__nvvm_activemask()); }

// Any trivially copyable value through 32-bit shuffles.
template <class T>
inline T shuffle_idx(uint32_t mask, T x, uint32_t src) {
  constexpr int W = int((sizeof(T) + 3) / 4);
  uint32_t w[W] = {};
  __builtin_memcpy(w, &x, sizeof(T));
  for (int i = 0; i < W; ++i) w[i] = uint32_t(__nvvm_shfl_sync_idx_i32(mask, int(w[i]), int(src), 31));
  T r;
  __builtin_memcpy(&r, w, sizeof(T));
  return r;
}
template <class T>
inline T shuffle_bfly(uint32_t mask, T x, int lane_mask) {
  constexpr int W = int((sizeof(T) + 3) / 4);
  uint32_t w[W] = {};
  __builtin_memcpy(w, &x, sizeof(T));
  for (int i = 0; i < W; ++i) w[i] = uint32_t(__nvvm_shfl_sync_bfly_i32(mask, int(w[i]), lane_mask, 31));
  T r;
  __builtin_memcpy(&r, w, sizeof(T));
  return r;
}
// The Metal rule for a shuffle source: an inactive or out-of-range lane gives the lane's own value.
template <class T>
inline T shuffle_from(T x, int src) {
  uint32_t mask = active(), me = lane();
  bool ok = src >= 0 && src < 32 && ((mask >> src) & 1u);
  return shuffle_idx(mask, x, ok ? uint32_t(src) : me);
}
struct Add {
  template <class T>
  T operator()(T a, T b) const { return a + b; }
};
struct Mul {
  template <class T>
  T operator()(T a, T b) const { return a * b; }
};
struct Max {
  template <class T>
  T operator()(T a, T b) const { return metal::max(a, b); }
};
struct Min {
  template <class T>
  T operator()(T a, T b) const { return metal::min(a, b); }
};
struct And {
  template <class T>
  T operator()(T a, T b) const { return T(a & b); }
};
struct Or {
  template <class T>
  T operator()(T a, T b) const { return T(a | b); }
};
struct Xor {
  template <class T>
  T operator()(T a, T b) const { return T(a ^ b); }
};
// 32-bit integer reductions the hardware does in one redux.sync over the active lanes (sm_80 on).
template <class T, class Op>
constexpr bool has_redux = std::is_integral_v<T> && sizeof(T) == 4 &&
                           (std::is_same_v<Op, Add> || std::is_same_v<Op, Max> || std::is_same_v<Op, Min> ||
                            std::is_same_v<Op, And> || std::is_same_v<Op, Or> || std::is_same_v<Op, Xor>);
template <class T, class Op>
inline T redux(T x, uint32_t mask) {
  const int v = int(x);
  if constexpr (std::is_same_v<Op, Add>) {
    return T(__nvvm_redux_sync_add(v, mask));
  } else if constexpr (std::is_same_v<Op, And>) {
    return T(__nvvm_redux_sync_and(v, mask));
  } else if constexpr (std::is_same_v<Op, Or>) {
    return T(__nvvm_redux_sync_or(v, mask));
  } else if constexpr (std::is_same_v<Op, Xor>) {
    return T(__nvvm_redux_sync_xor(v, mask));
  } else if constexpr (std::is_same_v<Op, Max>) {
    return std::is_signed_v<T> ? T(__nvvm_redux_sync_max(v, mask)) : T(__nvvm_redux_sync_umax(uint32_t(x), mask));
  } else {
    static_assert(std::is_same_v<Op, Min>);
    return std::is_signed_v<T> ? T(__nvvm_redux_sync_min(v, mask)) : T(__nvvm_redux_sync_umin(uint32_t(x), mask));
  }
}
// A reduction over the active lanes: one redux.sync for 32-bit integers, else butterflies for a full warp and a
// lane-ordered pass otherwise (the CPU harness's order).
template <class T, class Op>
inline T reduce(T x, Op op) {
  uint32_t mask = active();
  if constexpr (has_redux<T, Op>) {
    return redux<T, Op>(x, mask);
  } else {
    if (mask == 0xFFFFFFFFu) {
      for (int d = 16; d >= 1; d /= 2) x = op(x, shuffle_bfly(mask, x, d));
      return x;
    }
    T acc = shuffle_idx(mask, x, uint32_t(__builtin_ctz(mask)));
    for (uint32_t m = mask & (mask - 1); m; m &= m - 1) {
      acc = op(acc, shuffle_idx(mask, x, uint32_t(__builtin_ctz(m))));
    }
    return acc;
  }
}
// Prefix over the active lanes in lane order (as the CPU harness), inclusive or exclusive. A 5-step scan of
// up-shuffles for integers measured slower: with the redux sums the one-threadgroup sampler took 1.60 ms against
// 1.41 (docs/performance.md, fourteenth session).
template <class T, class Op>
inline T prefix(T x, Op op, T identity, bool inclusive) {
  uint32_t mask = active(), me = lane();
  T acc = identity;
  for (uint32_t m = mask; m; m &= m - 1) {
    uint32_t l = uint32_t(__builtin_ctz(m));
    T v = shuffle_idx(mask, x, l);
    if (l < me || (inclusive && l == me)) acc = op(acc, v);
  }
  return acc;
}
}  // namespace cuda_detail

// bar.sync orders shared and global memory among the threadgroup's threads, whatever the flags.
inline void threadgroup_barrier_at(const char*, mem_flags = mem_flags::mem_none) { __nvvm_barrier_sync(0); }
inline void simdgroup_barrier_at(const char*, mem_flags = mem_flags::mem_none) {
  __nvvm_bar_warp_sync(cuda_detail::active());
}

template <class T>
T simd_sum_at(const char*, T x) { return cuda_detail::reduce(x, cuda_detail::Add{}); }
template <class T>
T simd_product_at(const char*, T x) { return cuda_detail::reduce(x, cuda_detail::Mul{}); }
template <class T>
T simd_max_at(const char*, T x) { return cuda_detail::reduce(x, cuda_detail::Max{}); }
template <class T>
T simd_min_at(const char*, T x) { return cuda_detail::reduce(x, cuda_detail::Min{}); }
template <class T>
T simd_and_at(const char*, T x) { return cuda_detail::reduce(x, cuda_detail::And{}); }
template <class T>
T simd_or_at(const char*, T x) { return cuda_detail::reduce(x, cuda_detail::Or{}); }
template <class T>
T simd_xor_at(const char*, T x) { return cuda_detail::reduce(x, cuda_detail::Xor{}); }
template <class T>
T simd_prefix_inclusive_sum_at(const char*, T x) { return cuda_detail::prefix(x, cuda_detail::Add{}, T(0), true); }
template <class T>
T simd_prefix_exclusive_sum_at(const char*, T x) { return cuda_detail::prefix(x, cuda_detail::Add{}, T(0), false); }
template <class T>
T simd_prefix_inclusive_product_at(const char*, T x) {
  return cuda_detail::prefix(x, cuda_detail::Mul{}, T(1), true);
}
template <class T>
T simd_prefix_exclusive_product_at(const char*, T x) {
  return cuda_detail::prefix(x, cuda_detail::Mul{}, T(1), false);
}
template <class T>
T simd_shuffle_at(const char*, T x, ushort lane) { return cuda_detail::shuffle_from(x, int(lane)); }
template <class T>
T simd_broadcast_at(const char*, T x, ushort lane) { return cuda_detail::shuffle_from(x, int(lane)); }
template <class T>
T simd_shuffle_xor_at(const char*, T x, ushort mask) {
  return cuda_detail::shuffle_from(x, int(cuda_detail::lane() ^ mask));
}
template <class T>
T simd_shuffle_down_at(const char*, T x, ushort delta) {
  return cuda_detail::shuffle_from(x, int(cuda_detail::lane() + delta));
}
template <class T>
T simd_shuffle_up_at(const char*, T x, ushort delta) {
  return cuda_detail::shuffle_from(x, int(cuda_detail::lane()) - int(delta));
}
template <class T>
T simd_broadcast_first_at(const char*, T x) {
  uint32_t mask = cuda_detail::active();
  return cuda_detail::shuffle_idx(mask, x, uint32_t(__builtin_ctz(mask)));
}

struct simd_vote {
  using vote_t = uint64_t;
  vote_t bits;
  explicit constexpr simd_vote(vote_t v = 0) : bits(v) {}
  explicit constexpr operator vote_t() const { return bits; }
  bool all() const { return bits == 0xFFFFFFFFull; }
  bool any() const { return bits != 0; }
};
inline simd_vote simd_ballot_at(const char*, bool pred) {
  return simd_vote(uint32_t(__nvvm_vote_ballot_sync(cuda_detail::active(), pred)));
}
inline simd_vote simd_active_threads_mask_at(const char*) { return simd_vote(cuda_detail::active()); }
inline bool simd_all_at(const char*, bool pred) { return __nvvm_vote_all_sync(cuda_detail::active(), pred); }
inline bool simd_any_at(const char*, bool pred) { return __nvvm_vote_any_sync(cuda_detail::active(), pred); }
inline bool simd_is_first_at(const char*) {
  return cuda_detail::lane() == uint32_t(__builtin_ctz(cuda_detail::active()));
}

// ---- atomics: relaxed, as Metal's; add as one atom instruction, the rest by compare-exchange ----
enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release, memory_order_acq_rel, memory_order_seq_cst };
template <class T>
struct _atomic {
  T value;
};
template <class T>
using atomic = _atomic<T>;
typedef _atomic<int> atomic_int;
typedef _atomic<uint> atomic_uint;
typedef _atomic<float> atomic_float;
typedef _atomic<bool> atomic_bool;

namespace atomic_detail {
template <class T>
inline T* generic(volatile T __attribute__((address_space(1)))* p) { return (T*)p; }
template <class T>
inline T* generic(volatile T __attribute__((address_space(3)))* p) { return (T*)p; }
template <class T, class F>
inline T rmw(T* p, F f) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  T desired = f(old);
  while (!__atomic_compare_exchange(p, &old, &desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) desired = f(old);
  return old;
}
}  // namespace atomic_detail

#define MSL_CUDA_ATOMIC_AS(AS)                                                                       \
  template <class T>                                                                                 \
  inline T atomic_load_explicit(volatile AS _atomic<T>* o, memory_order = memory_order_relaxed) {    \
    return __atomic_load_n(atomic_detail::generic(&o->value), __ATOMIC_RELAXED);                     \
  }                                                                                                  \
  template <class T, class U>                                                                        \
  inline void atomic_store_explicit(volatile AS _atomic<T>* o, U v, memory_order = memory_order_relaxed) { \
    __atomic_store_n(atomic_detail::generic(&o->value), static_cast<T>(v), __ATOMIC_RELAXED);        \
  }                                                                                                  \
  template <class T, class U>                                                                        \
  inline T atomic_exchange_explicit(volatile AS _atomic<T>* o, U v, memory_order = memory_order_relaxed) { \
    return __atomic_exchange_n(atomic_detail::generic(&o->value), static_cast<T>(v), __ATOMIC_RELAXED); \
  }                                                                                                  \
  template <class T, class U>                                                                        \
  inline T atomic_fetch_add_explicit(volatile AS _atomic<T>* o, U v, memory_order = memory_order_relaxed) { \
    return __atomic_fetch_add(atomic_detail::generic(&o->value), static_cast<T>(v), __ATOMIC_RELAXED); \
  }                                                                                                  \
  template <class T, class U>                                                                        \
  inline T atomic_fetch_sub_explicit(volatile AS _atomic<T>* o, U v, memory_order = memory_order_relaxed) { \
    return __atomic_fetch_sub(atomic_detail::generic(&o->value), static_cast<T>(v), __ATOMIC_RELAXED); \
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
    return __atomic_fetch_and(atomic_detail::generic(&o->value), static_cast<T>(v), __ATOMIC_RELAXED); \
  }                                                                                                  \
  template <class T, class U>                                                                        \
  inline T atomic_fetch_or_explicit(volatile AS _atomic<T>* o, U v, memory_order = memory_order_relaxed) { \
    return __atomic_fetch_or(atomic_detail::generic(&o->value), static_cast<T>(v), __ATOMIC_RELAXED); \
  }                                                                                                  \
  template <class T, class U>                                                                        \
  inline T atomic_fetch_xor_explicit(volatile AS _atomic<T>* o, U v, memory_order = memory_order_relaxed) { \
    return __atomic_fetch_xor(atomic_detail::generic(&o->value), static_cast<T>(v), __ATOMIC_RELAXED); \
  }                                                                                                  \
  template <class T, class U>                                                                        \
  inline bool atomic_compare_exchange_weak_explicit(volatile AS _atomic<T>* o, T* expected, U desired, \
                                                    memory_order = memory_order_relaxed,             \
                                                    memory_order = memory_order_relaxed) {           \
    T d = static_cast<T>(desired);                                                                   \
    return __atomic_compare_exchange(atomic_detail::generic(&o->value), expected, &d, false,         \
                                     __ATOMIC_RELAXED, __ATOMIC_RELAXED);                            \
  }
MSL_CUDA_ATOMIC_AS(__attribute__((address_space(1))))
MSL_CUDA_ATOMIC_AS(__attribute__((address_space(3))))
#undef MSL_CUDA_ATOMIC_AS

// ---- simdgroup_matrix<T, 8, 8> operations on a warp ----
// The lane layout is NVIDIA's mma fragment layout, not Apple's: lane l holds (l / 4, 2·(l % 4)) and the element after
// it, which is the accumulator and A-operand layout of mma.sync, so a bf16/f16 MMA runs on tensor cores with no lane
// exchange (the B operand is one movmatrix transpose). Apple leaves the layout unspecified; kernels that read
// thread_elements() by position take it from lily.h (attn_mma_row/col), and the engine checks that with
// simdgroup_layout_probe.
namespace matrix_detail {
// Row and first column of the two elements lane `lane` holds: (row, col) and (row, col + 1).
constexpr int lane_row(uint32_t lane) { return int(lane / 4); }
constexpr int lane_col(uint32_t lane) { return int(lane % 4) * 2; }

// The two 16-bit elements as one register, element 0 in the low half. A bit cast of the whole vector: clang 19's NVPTX
// back end lowered v[1] of a bfloat2 to v[0] (the PTX packed one load twice).
template <class T>
inline uint32_t pack_b16(vec<T, 2> v) {
  return __builtin_bit_cast(uint32_t, v);
}
// One m16n8k8 tensor-core MMA of 16-bit (bf16 or f16) operands with fp32 accumulation, d = a·b + c: A's rows 0-7
// in a_top and 8-15 in a_bottom (fragment registers), B column-major in bt; d and c hold rows 0-7 (elements 0, 1)
// and 8-15 (2, 3) of the lane's accumulator fragment.
template <class T>
__attribute__((always_inline)) inline void mma_m16n8k8(float (&d)[4], uint32_t a_top, uint32_t a_bottom, uint32_t bt,
                                                       const float (&c)[4]) {
  if constexpr (std::is_same_v<T, bfloat>) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %8, %9, %10};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a_top), "r"(a_bottom), "r"(bt), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
  } else {
    static_assert(std::is_same_v<T, half>, "bf16 or f16 operands");
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %8, %9, %10};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a_top), "r"(a_bottom), "r"(bt), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
  }
}
// D = A·B + C for 16-bit A and B on tensor cores: the upper half of one m16n8k8 MMA (rows 8..15 of A are zero), fp32
// accumulation. A's fragment is its storage; B's is the transpose of its storage layout (movmatrix).
template <class T>
inline void mma_b16(float (&acc)[2], vec<T, 2> a, vec<T, 2> b) {
  uint32_t bt;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(bt) : "r"(pack_b16(b)));
  float d[4];
  mma_m16n8k8<T>(d, pack_b16(a), 0u, bt, {acc[0], acc[1], 0.0f, 0.0f});
  acc[0] = d[0];
  acc[1] = d[1];
}
// fp32 A and B on tensor cores, split in two TF32 halves (x = hi + lo, each rounded to TF32's 11 significant bits):
// one m16n8k8 TF32 MMA takes A's hi in rows 0-7 and A's lo in rows 8-15 against B's hi, a second against B's lo, and
// the two row halves are added to c, so d = c + a·b keeps about fp32's 24 bits for 4 shuffles instead of
// mma_exact's 24. The products are exact, but the tensor core's fp32 sums truncate: c is added outside the MMAs, in
// rounded fp32 (with c inside, the truncation of a long accumulation failed the f32 kernels' tolerances on an
// H200). A's fragment is its storage under a permutation of k (MMA position p < 4 is k = 2p, p + 4 is k = 2p + 1,
// the same on both sides of the product); B's lanes gather rows 2t and 2t + 1 of their column g.
// LILY_CUDA_EXACT_F32_MMA selects mma_exact instead.
inline uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
inline void mma_tf32x2(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
inline void mma_f32(float (&acc)[2], vec<float, 2> a, vec<float, 2> b) {
  const uint32_t full = 0xFFFFFFFFu, me = __nvvm_read_ptx_sreg_laneid();
  const uint32_t g = me / 4, t = me % 4;
  const uint32_t even_row = 8 * t + g / 2, odd_row = even_row + 4;  // the lanes holding B(2t, g) and B(2t + 1, g)
  const float e0 = cuda_detail::shuffle_idx(full, b[0], even_row), e1 = cuda_detail::shuffle_idx(full, b[1], even_row);
  const float o0 = cuda_detail::shuffle_idx(full, b[0], odd_row), o1 = cuda_detail::shuffle_idx(full, b[1], odd_row);
  const float b_even = (g & 1u) ? e1 : e0, b_odd = (g & 1u) ? o1 : o0;
  const uint32_t a_hi0 = to_tf32(a[0]), a_hi1 = to_tf32(a[1]);
  const uint32_t b_hi0 = to_tf32(b_even), b_hi1 = to_tf32(b_odd);
  const uint32_t a_frag[4] = {a_hi0, to_tf32(a[0] - __builtin_bit_cast(float, a_hi0)), a_hi1,
                              to_tf32(a[1] - __builtin_bit_cast(float, a_hi1))};
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  mma_tf32x2(d, a_frag, to_tf32(b_even - __builtin_bit_cast(float, b_hi0)),
             to_tf32(b_odd - __builtin_bit_cast(float, b_hi1)));
  mma_tf32x2(d, a_frag, b_hi0, b_hi1);
  acc[0] += d[0] + d[2];
  acc[1] += d[1] + d[3];
}
// Mixed element types, and fp32 with LILY_CUDA_EXACT_F32_MMA: fp32 products and sums, k in order, as the CPU
// harness; 24 shuffles per MMA.
template <class TA, class TB>
inline void mma_exact(float (&acc)[2], vec<TA, 2> a, vec<TB, 2> b) {
  const uint32_t full = 0xFFFFFFFFu, me = __nvvm_read_ptx_sreg_laneid();
  const uint32_t row = me / 4, pair = me % 4;
#pragma unroll
  for (uint32_t k = 0; k < 8; ++k) {
    const float ak = cuda_detail::shuffle_idx(full, float(a[k & 1]), 4 * row + k / 2);  // A(row, k)
    const float b0 = cuda_detail::shuffle_idx(full, float(b[0]), 4 * k + pair);          // B(k, 2·pair)
    const float b1 = cuda_detail::shuffle_idx(full, float(b[1]), 4 * k + pair);          // B(k, 2·pair + 1)
    acc[0] += ak * b0;
    acc[1] += ak * b1;
  }
}
// An 8x8 matrix of 16-bit elements from threadgroup memory in one ldmatrix: lanes 0-7 give the addresses of rows
// 0-7, and every lane receives its two elements in the fragment layout above (with .trans, of the transpose: element
// (r, c) = row c's element r, which is simdgroup_load's transposed load). Needs each row 16-byte aligned: the caller
// checks that with ldmatrix_aligned (uniform over the simdgroup) and otherwise loads element by element.
template <class S>
inline bool ldmatrix_aligned(const __attribute__((address_space(3))) S* first, ulong elements_per_row) {
  return ((reinterpret_cast<uintptr_t>(first) | (elements_per_row * sizeof(S))) & 15u) == 0;
}
template <class S>
inline uint32_t ldmatrix(const __attribute__((address_space(3))) S* first, ulong elements_per_row, bool transpose) {
  const uint32_t lane = __nvvm_read_ptx_sreg_laneid();
  const uint32_t row = uint32_t(reinterpret_cast<uintptr_t>(first + (lane % 8) * elements_per_row));
  uint32_t v;
  if (transpose) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];" : "=r"(v) : "r"(row) : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(v) : "r"(row) : "memory");
  }
  return v;
}

template <class TD, class TA, class TB, class TC>
inline void mma(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>* c) {
  float acc[2] = {c ? float(c->elements[0]) : 0.0f, c ? float(c->elements[1]) : 0.0f};
  constexpr bool kB16 = (std::is_same_v<TA, bfloat> || std::is_same_v<TA, half>) && std::is_same_v<TA, TB>;
  constexpr bool kF32 = std::is_same_v<TA, float> && std::is_same_v<TB, float>;
  if constexpr (kB16) {
    mma_b16<TA>(acc, a.elements, b.elements);
#ifndef LILY_CUDA_EXACT_F32_MMA
  } else if constexpr (kF32) {
    mma_f32(acc, a.elements, b.elements);
#endif
  } else {
    mma_exact(acc, a.elements, b.elements);
  }
  d.elements = vec<TD, 2>{static_cast<TD>(acc[0]), static_cast<TD>(acc[1])};
}
}  // namespace matrix_detail

template <class T, int R, int C>
inline simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, R, C> m;
  m.elements = vec<T, 2>{value, value};
  return m;
}

#define MSL_CUDA_MATRIX_AS(AS, SHARED)                                                                \
  template <class T, class S>                                                                         \
  inline void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const AS S* src, ulong elements_per_row = 8, \
                             ulong2 matrix_origin = ulong2{0, 0}, bool transpose = false) {           \
    if constexpr (SHARED && sizeof(S) == 2 && std::is_same_v<T, S>) {                                 \
      const AS S* first = src + matrix_origin.y * elements_per_row + matrix_origin.x;                 \
      if (matrix_detail::ldmatrix_aligned(first, elements_per_row)) {                                 \
        d.elements = __builtin_bit_cast(vec<T, 2>, matrix_detail::ldmatrix(first, elements_per_row, transpose)); \
        return;                                                                                       \
      }                                                                                               \
    }                                                                                                 \
    uint32_t lane = __nvvm_read_ptx_sreg_laneid();                                                    \
    int r = matrix_detail::lane_row(lane), c = matrix_detail::lane_col(lane);                         \
    for (int e = 0; e < 2; ++e) {                                                                     \
      ulong row = transpose ? ulong(c + e) : ulong(r), col = transpose ? ulong(r) : ulong(c + e);     \
      d.elements[e] = static_cast<T>(src[(matrix_origin.y + row) * elements_per_row + matrix_origin.x + col]); \
    }                                                                                                 \
  }                                                                                                   \
  template <class T, class S>                                                                         \
  inline void simdgroup_store(simdgroup_matrix<T, 8, 8> m, AS S* dst, ulong elements_per_row = 8,     \
                              ulong2 matrix_origin = ulong2{0, 0}, bool transpose = false) {          \
    uint32_t lane = __nvvm_read_ptx_sreg_laneid();                                                    \
    int r = matrix_detail::lane_row(lane), c = matrix_detail::lane_col(lane);                         \
    for (int e = 0; e < 2; ++e) {                                                                     \
      ulong row = transpose ? ulong(c + e) : ulong(r), col = transpose ? ulong(r) : ulong(c + e);     \
      dst[(matrix_origin.y + row) * elements_per_row + matrix_origin.x + col] = static_cast<S>(m.elements[e]); \
    }                                                                                                 \
  }
MSL_CUDA_MATRIX_AS(__attribute__((address_space(1))), false)
MSL_CUDA_MATRIX_AS(__attribute__((address_space(3))), true)
#undef MSL_CUDA_MATRIX_AS

template <class TD, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate_at(const char*, simdgroup_matrix<TD, 8, 8>& d,
                                             const simdgroup_matrix<TA, 8, 8>& a,
                                             const simdgroup_matrix<TB, 8, 8>& b,
                                             const simdgroup_matrix<TC, 8, 8>& c) {
  matrix_detail::mma(d, a, b, &c);
}
template <class TD, class TA, class TB>
inline void simdgroup_multiply_at(const char*, simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                  const simdgroup_matrix<TB, 8, 8>& b) {
  matrix_detail::mma(d, a, b, static_cast<const simdgroup_matrix<TD, 8, 8>*>(nullptr));
}

// Not Metal: acc[fm · FN + fn] += a[fm] · b[fn] for a block of fragments (lily::gemm_mma_block calls it under
// MSL_CUDA). With 16-bit A and B, each B fragment is transposed once (movmatrix) and two A fragments share one
// m16n8k8 MMA as its rows 0-7 and 8-15: the same products and fp32 sums as one 8x8 MMA each, half the tensor-core
// instructions and none half empty. Other types run the exact per-fragment MMA.
template <uint32_t FM, uint32_t FN, class T>
__attribute__((always_inline)) inline void simdgroup_multiply_accumulate_pairs(simdgroup_matrix<float, 8, 8>* acc,
                                                const simdgroup_matrix<T, 8, 8>* a,
                                                const simdgroup_matrix<T, 8, 8>* b) {
  if constexpr (std::is_same_v<T, bfloat> || std::is_same_v<T, half>) {
#pragma unroll
    for (uint32_t fn = 0; fn < FN; ++fn) {
      uint32_t bt;
      asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(bt) : "r"(matrix_detail::pack_b16(b[fn].elements)));
#pragma unroll
      for (uint32_t fm = 0; fm < FM; fm += 2) {
        const bool pair = fm + 1 < FM;
        vec<float, 2>& top = acc[fm * FN + fn].elements;
        const vec<float, 2> bottom = pair ? acc[(fm + 1) * FN + fn].elements : vec<float, 2>{0.0f, 0.0f};
        const uint32_t a_top = matrix_detail::pack_b16(a[fm].elements);
        const uint32_t a_bottom = pair ? matrix_detail::pack_b16(a[fm + 1].elements) : 0u;
        float d[4];
        matrix_detail::mma_m16n8k8<T>(d, a_top, a_bottom, bt, {top[0], top[1], bottom[0], bottom[1]});
        top = vec<float, 2>{d[0], d[1]};
        if (pair) acc[(fm + 1) * FN + fn].elements = vec<float, 2>{d[2], d[3]};
      }
    }
  } else {
    for (uint32_t fm = 0; fm < FM; ++fm) {
      for (uint32_t fn = 0; fn < FN; ++fn) {
        matrix_detail::mma(acc[fm * FN + fn], a[fm], b[fn], &acc[fm * FN + fn]);
      }
    }
  }
}

// Not Metal: the fragment registers of 16-bit 8x8 tiles in threadgroup memory, for callers whose tile rows are
// 16-byte aligned by construction (lily::gemm_mma_step's operand tiles; simdgroup_load tests the alignment at run
// time and falls back to element loads). Lane l addresses row l % 8 of matrix l / 8: matrix j's rows start at
// first + 8·j elements (four consecutive 8-wide column blocks of the same 8 rows, e.g. a 32-deep K step) and
// regs[j] is its fragment, the rows as stored: an A operand, or, read from the rows of B^T (a [N][K] weight tile),
// mma.sync's column-major B operand with no transpose.
template <class S>
__attribute__((always_inline)) inline void simdgroup_fragment_rows_x4(uint32_t (&regs)[4],
                                                                      const __attribute__((address_space(3))) S* first,
                                                                      uint32_t elements_per_row) {
  static_assert(sizeof(S) == 2, "16-bit tiles");
  const uint32_t lane = __nvvm_read_ptx_sreg_laneid();
  const uint32_t row = uint32_t(reinterpret_cast<uintptr_t>(first + (lane % 8) * elements_per_row + 8 * (lane / 8)));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
               : "r"(row)
               : "memory");
}
// Not Metal: acc[fm · FN + fn] += A_fm · B_fn for raw fragment registers (simdgroup_fragment_rows_x4): a[fm] of A's
// rows, bt[fn] of B^T's rows, two A fragments per m16n8k8 MMA as in simdgroup_multiply_accumulate_pairs (the same
// products and fp32 sums), without its movmatrix: B^T's rows are the B operand's layout.
template <class T, uint32_t FM, uint32_t FN>
__attribute__((always_inline)) inline void simdgroup_multiply_accumulate_rows(simdgroup_matrix<float, 8, 8>* acc,
                                                                              const uint32_t* a, const uint32_t* bt) {
  static_assert(FM % 2 == 0, "pairs of A fragments");
#pragma unroll
  for (uint32_t fn = 0; fn < FN; ++fn) {
#pragma unroll
    for (uint32_t fm = 0; fm < FM; fm += 2) {
      vec<float, 2>& top = acc[fm * FN + fn].elements;
      vec<float, 2>& bottom = acc[(fm + 1) * FN + fn].elements;
      float d[4];
      matrix_detail::mma_m16n8k8<T>(d, a[fm], a[fm + 1], bt[fn], {top[0], top[1], bottom[0], bottom[1]});
      top = vec<float, 2>{d[0], d[1]};
      bottom = vec<float, 2>{d[2], d[3]};
    }
  }
}
