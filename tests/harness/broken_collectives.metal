// Deliberately broken (harness self-test): lanes of one simdgroup meet different SIMD collectives.
#include <metal_stdlib>

using namespace metal;

// Half the lanes sum while the other half take the maximum.
[[kernel]] void broken_collective_kinds(device const float* in [[buffer(0)]],
                                        device float* out [[buffer(1)]],
                                        uint tid [[thread_position_in_grid]],
                                        uint lane [[thread_index_in_simdgroup]]) {
  float v = in[tid];
  out[tid] = lane < 16 ? simd_sum(v) : simd_max(v);
}

// Lanes 16..31 skip the collective and wait at the barrier instead (a wrong lane mask in the condition).
[[kernel]] void broken_collective_skipped(device const float* in [[buffer(0)]],
                                          device float* out [[buffer(1)]],
                                          uint tid [[thread_position_in_grid]],
                                          uint lane [[thread_index_in_simdgroup]]) {
  float v = in[tid];
  if (lane < 16) {
    v = simd_sum(v);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = v;
}
