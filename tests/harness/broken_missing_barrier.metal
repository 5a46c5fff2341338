// Deliberately broken (harness self-test): with `use_barrier` false a threadgroup reads a neighbour's slot of
// threadgroup memory with no barrier after the writes, so it may read the poison (NaN) or a stale value.
#include <metal_stdlib>

using namespace metal;

constant bool use_barrier [[function_constant(0)]];

[[kernel]] void broken_missing_barrier(device const float* in [[buffer(0)]],
                                       device float* out [[buffer(1)]],
                                       uint tid [[thread_index_in_threadgroup]],
                                       uint n [[threads_per_threadgroup]]) {
  threadgroup float shared[256];
  shared[tid] = in[tid];
  if (is_function_constant_defined(use_barrier) && use_barrier) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[tid] = shared[(tid + 1) % n];
}
