// Deliberately broken (harness self-test): writes one element past the end of a buffer or threadgroup array.
#include <metal_stdlib>

using namespace metal;

// Every thread writes out[tid + 1]: the last one writes past the end of buffer(1).
[[kernel]] void broken_device_overflow(device const float* in [[buffer(0)]],
                                       device float* out [[buffer(1)]],
                                       uint tid [[thread_position_in_grid]]) {
  out[tid + 1] = in[tid];
}

// Every thread writes scratch[tid + 1] of a 32-element threadgroup array.
[[kernel]] void broken_threadgroup_overflow(device float* out [[buffer(0)]],
                                            uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float scratch[32];
  scratch[tid + 1] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = scratch[tid];
}
