// Harness self-test kernels that are correct MSL: they pin down the shim's semantics (tests/harness/test_harness.py).
#include <metal_stdlib>

using namespace metal;

// MSL vector constructors convert element-wise; swizzles; scalar splats.
[[kernel]] void harness_vector_semantics(device const int4* ints [[buffer(0)]],
                                         device float4* converted [[buffer(1)]],
                                         device float4* swizzled [[buffer(2)]],
                                         device half4* narrowed [[buffer(3)]],
                                         uint tid [[thread_position_in_grid]]) {
  int4 i = ints[tid];
  float4 f = float4(i);
  converted[tid] = f;
  swizzled[tid] = float4(f.wz, float2(7.0f)) + float4(0.5f);
  narrowed[tid] = half4(f * 0.5f);
}

// Element-wise a*b + c in one expression: each operation must round to T (no float excess precision).
template <typename T>
[[kernel]] void harness_mul_add(device const T* a [[buffer(0)]],
                                device const T* b [[buffer(1)]],
                                device const T* c [[buffer(2)]],
                                device T* out [[buffer(3)]],
                                uint tid [[thread_position_in_grid]]) {
  out[tid] = a[tid] * b[tid] + c[tid];
}
template [[host_name("harness_mul_add_f16")]] [[kernel]] decltype(harness_mul_add<half>) harness_mul_add<half>;
template [[host_name("harness_mul_add_bf16")]] [[kernel]] decltype(harness_mul_add<bfloat>) harness_mul_add<bfloat>;

// D = A*B + C for one 8x8 tile (float), A loaded transposed from `a_t` when the constant is set.
constant bool load_a_transposed [[function_constant(0)]];
[[kernel]] void harness_simdgroup_mma(device const float* a [[buffer(0)]],
                                      device const float* b [[buffer(1)]],
                                      device const float* c [[buffer(2)]],
                                      device float* d [[buffer(3)]]) {
  simdgroup_float8x8 ma, mb, mc;
  simdgroup_load(ma, a, 8, ulong2(0, 0), load_a_transposed);
  simdgroup_load(mb, b);
  simdgroup_load(mc, c);
  simdgroup_float8x8 md;
  simdgroup_multiply_accumulate(md, ma, mb, mc);
  simdgroup_store(md, d);
}

// Atomics from every thread of every threadgroup.
[[kernel]] void harness_atomics(device atomic_uint* counter [[buffer(0)]],
                                device atomic_int* maximum [[buffer(1)]],
                                device atomic_float* total [[buffer(2)]],
                                device const int* values [[buffer(3)]],
                                uint tid [[thread_position_in_grid]]) {
  atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
  atomic_fetch_max_explicit(maximum, values[tid], memory_order_relaxed);
  atomic_fetch_add_explicit(total, 0.5f, memory_order_relaxed);
}

// Every SIMD collective once per thread; 12 results per thread.
[[kernel]] void harness_simd_collectives(device const int* values [[buffer(0)]],
                                         device int* out [[buffer(1)]],
                                         uint tid [[thread_position_in_grid]]) {
  int v = values[tid];
  device int* o = out + tid * 12;
  o[0] = simd_sum(v);
  o[1] = simd_max(v);
  o[2] = simd_min(v);
  o[3] = simd_prefix_inclusive_sum(v);
  o[4] = simd_prefix_exclusive_sum(v);
  o[5] = simd_shuffle_xor(v, ushort(1));
  o[6] = simd_shuffle_down(v, ushort(3));
  o[7] = simd_broadcast(v, ushort(2));
  o[8] = int(uint64_t(simd_ballot(v > 0)) & 0xFFFFFFFFu);
  o[9] = simd_is_first() ? 1 : 0;
  o[10] = (simd_all(v > -1000) ? 1 : 0) + (simd_any(v > 0) ? 2 : 0);
  o[11] = simd_shuffle_up(v, ushort(1));
}

// Threadgroup memory bound with setThreadgroupMemoryLength: reverse each threadgroup's slice.
[[kernel]] void harness_threadgroup_param(device const float* in [[buffer(0)]],
                                          device float* out [[buffer(1)]],
                                          threadgroup float* scratch [[threadgroup(0)]],
                                          uint tid [[thread_position_in_grid]],
                                          uint local [[thread_index_in_threadgroup]],
                                          uint n [[threads_per_threadgroup]]) {
  scratch[local] = in[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = scratch[n - 1 - local];
}
