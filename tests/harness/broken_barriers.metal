// Deliberately broken (harness self-test): threads of one threadgroup do not all reach the same barrier.
#include <metal_stdlib>

using namespace metal;

// Threads past the data return early, then the rest wait at a barrier they can never all reach.
[[kernel]] void broken_barrier_early_return(device const float* in [[buffer(0)]],
                                            device float* out [[buffer(1)]],
                                            constant uint& count [[buffer(2)]],
                                            uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float shared[64];
  if (tid >= count) {
    return;
  }
  shared[tid] = in[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = shared[count - 1 - tid];
}

// Even and odd threads wait at two different barriers.
[[kernel]] void broken_barrier_branches(device float* out [[buffer(0)]],
                                        uint tid [[thread_index_in_threadgroup]]) {
  if (tid % 2 == 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = 1.0f;
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = 2.0f;
  }
}
