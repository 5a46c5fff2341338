// Deliberately broken (harness self-test): a threadgroup_barrier whose mem_flags lack mem_threadgroup between a
// threadgroup write and another thread's read. It waits for every thread but does not make the writes visible on a
// GPU; the harness reports it. With `fenced` true the barrier has mem_threadgroup and the kernel is correct.
#include <metal_stdlib>

using namespace metal;

constant bool fenced [[function_constant(0)]];

[[kernel]] void broken_barrier_flags(device const float* in [[buffer(0)]],
                                     device float* out [[buffer(1)]],
                                     uint tid [[thread_index_in_threadgroup]],
                                     uint n [[threads_per_threadgroup]]) {
  threadgroup float shared[256];
  shared[tid] = in[tid];
  if (is_function_constant_defined(fenced) && fenced) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_device);
  }
  out[tid] = shared[(tid + 1) % n];
}
